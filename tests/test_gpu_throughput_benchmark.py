"""Smoke test of benchmarks/gpu_throughput.py in its --tiny --device cpu mode (2 timed steps)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

from automodel.mesh.testing import run_on_ranks

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_throughput.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_throughput"] = module
    spec.loader.exec_module(module)
    return module


def test_flops_per_token_by_hand() -> None:
    bench = _load()
    model = bench.build_model(bench.TINY, 32, torch.device("meta"))
    # per layer: q 64*64, k,v 64*32, o 64*64, gate/up/down 3*64*128, two norms 2*64; + lm_head 256*64
    # + final norm 64 (the untied input embedding is a lookup, not a matmul)
    n = 2 * (4096 + 2 * 2048 + 4096 + 3 * 8192 + 128) + 256 * 64 + 64
    attention = 12 * 2 * 4 * 16 * 32
    assert bench.flops_per_token(model, bench.TINY, 32) == 6 * n + attention == 591744


def _run_tiny() -> dict:
    return _load().main(["--tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--dtype", "fp32"])


def test_tiny_cpu_mode_runs_two_steps() -> None:
    (report,) = run_on_ranks(_run_tiny, world_size=1, timeout_s=300)
    (result,) = report["results"]
    assert report["steps"] == 2 and report["shape"] == "tiny" and report["seq_len"] == 32
    assert result["median_step_s"] > 0 and math.isclose(
        result["tokens_per_s_per_gpu"], 32 / result["median_step_s"]
    )
    assert math.isclose(result["mfu"], result["tflops_per_s"] / 989.0)
    assert result["fsdp"] == "automodel.fsdp2.FSDP2Manager"
    assert "torchtitan" in report["torchtitan"]
