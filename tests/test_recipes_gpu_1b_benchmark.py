"""benchmarks/recipes_gpu_1b.py on CPU: its configs are valid recipes configs for every variant at the
real 1B shape (so the GPU call cannot die on a key), its FLOPs/token match gpu_throughput's count of
the real model, and a tiny eager variant runs through the real CLI."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_flops_per_token_matches_the_model_count() -> None:
    bench, throughput = _load("recipes_gpu_1b"), _load("gpu_throughput")
    model = throughput.build_model(throughput.LLAMA_3_2_1B, 4096, torch.device("meta"))
    expected = throughput.flops_per_token(model, throughput.LLAMA_3_2_1B, 4096)
    assert bench.flops_per_token(bench.LLAMA_3_2_1B, 4096) == expected == 9_025_499_136


@pytest.mark.parametrize(
    "variant",
    ["fp32-master", "bf16", "fp32-master-eager", "bf16-eager", "bf16-liger", "bf16-fp8", "bf16-fp8-liger"],
)
def test_every_variant_is_a_valid_recipes_config(variant: str, tmp_path: Path) -> None:
    from automodel.recipes import load_config
    from automodel.recipes.plan import plan_layout

    bench = _load("recipes_gpu_1b")
    raw = bench.recipe(variant, out=tmp_path, shape=bench.LLAMA_3_2_1B, seq_len=4096, steps=20, device="cuda")
    cfg = load_config(raw)
    assert cfg.model.dtype == ("bfloat16" if variant.startswith("bf16") else "float32")
    assert raw["distributed"]["enable_compile"] is (not variant.endswith("-eager"))
    assert cfg.optimizer.kwargs["fused"] is True
    assert cfg.kernels.required is ("liger" in variant) and cfg.fp8.enabled is ("fp8" in variant)
    if "liger" in variant or "fp8" in variant:  # the model rules of the kernels pass on the 1B shape
        plan_layout(cfg, world_size=1, on_gpu=True)


def test_summary_is_the_median_after_warmup() -> None:
    bench = _load("recipes_gpu_1b")
    records = [
        {"step": s, "tokens_per_s": t, "peak_mem_bytes": m, "loss": 1.0}
        for s, t, m in [(1, 1.0, 2**30), (2, 10.0, 2**31), (3, 30.0, 2**30), (4, 20.0, 2**30)]
    ]
    got = bench.summarize(records, warmup=1, flops=10**12, peak_tflops=100.0)
    assert got["tokens_per_s"] == 20.0 and got["steps_timed"] == 3
    assert got["mfu"] == pytest.approx(0.2) and got["peak_mem_gib"] == 2.0
    with pytest.raises(ValueError, match="no step after"):
        bench.summarize(records, warmup=4, flops=1, peak_tflops=1.0)


def test_tiny_eager_variant_runs_through_the_cli() -> None:
    bench = _load("recipes_gpu_1b")
    report = bench.main(
        ["--tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--variants", "bf16-eager"]
    )
    (result,) = report["results"]
    assert result["variant"] == "bf16-eager" and result["tokens_per_s"] > 0 and result["steps_timed"] == 1
