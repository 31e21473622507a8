"""``kernels.liger`` and ``fp8`` through `recipes train` on one GPU (skipped without CUDA, or without
liger-kernel / torchao: bring their wheels in .whl/ for scripts/gpu_check.sh).

What CPU tests cannot check: Liger's Triton kernels (RMSNorm, RoPE, SwiGLU and the fused linear
CE that replaces the chunked loss) reproduce the fp32 run, and real float8 matmuls (tensorwise,
float8 all-gather, precomputed scales) follow the bf16 run as closely as bf16 follows fp32.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _cli_run import CliRun  # noqa: E402
from _recipe_helpers import AUTOMODEL_FP8, tiny_config  # noqa: E402

_FP32 = {"_target_": "torch.distributed.fsdp.MixedPrecisionPolicy"}  # no casts: full fp32
LIGER_LINE = "kernels.liger: rms_norm, rope, swiglu, fused_linear_cross_entropy on model_type 'llama'"
FP8_LINE = "fp8: torchao float8 tensorwise on 14 linear layers (float8 all-gather, precomputed scales"


def _run(out: Path, **sections: Any) -> CliRun:
    """`recipes train` of the tiny config on one GPU, 8 steps, no validation."""
    cfg = tiny_config(str(out), step_scheduler={"max_steps": 8, "val_every_steps": None}, **sections)
    cfg.pop("validation_dataset")
    return CliRun(out, cfg, 1)


def kernels_runs(tmp_path: Path) -> dict[str, CliRun]:
    """The runs of the tests below: fp32 with and without Liger; bf16 (the GPU default) with and
    without NeMo AutoModel's fp8 section."""
    fp32 = {"strategy": "fsdp2", "mp_policy": _FP32}
    return {
        "fp32": _run(tmp_path / "fp32", distributed=fp32),
        "liger": _run(tmp_path / "liger", distributed=fp32, kernels={"liger": True}),
        "bf16": _run(tmp_path / "bf16", distributed={"strategy": "fsdp2"}),
        "fp8": _run(tmp_path / "fp8", distributed={"strategy": "fsdp2"}, fp8=AUTOMODEL_FP8),
    }


def _launch(run: CliRun) -> tuple[list[dict], str]:
    """The run's metrics records and its stderr (where rank 0 says what it applied)."""
    proc = subprocess.run(run.write(), capture_output=True, text=True, timeout=900, cwd=run.out.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    return records, proc.stderr


def _needs(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not importable: install automodel-recipes[{extra}] (or its wheel in .whl/)")


@pytest.mark.gpu
def test_liger_kernels_reproduce_the_fp32_run(tmp_path: Path) -> None:
    """fp32 both: Liger's kernels and its fused linear CE (in the head loss) within 1e-3 relative
    of the run without them, every step; the start-up line names every patch."""
    _needs("liger_kernel", "kernels")
    runs = kernels_runs(tmp_path)
    ref, _ = _launch(runs["fp32"])
    got, log = _launch(runs["liger"])
    assert LIGER_LINE in log and "loss: Liger's fused linear cross-entropy" in log, log[-3000:]
    for r, g in zip(ref, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-3), (r["step"], r["loss"], g["loss"])


@pytest.mark.gpu
def test_fp8_follows_the_bf16_run(tmp_path: Path) -> None:
    """Real float8 matmuls (compute capability >= 8.9) with AutoModel's example section: every step
    within 5e-2 of the bf16 run (as bf16 is of fp32) and the loss falls; the start-up line says
    what was converted."""
    _needs("torchao", "fp8")
    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(
            f"float8 needs compute capability >= 8.9, this GPU has {torch.cuda.get_device_capability()}"
        )
    runs = kernels_runs(tmp_path)
    ref, _ = _launch(runs["bf16"])
    got, log = _launch(runs["fp8"])
    assert FP8_LINE in log, log[-3000:]
    for r, g in zip(ref, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=5e-2), (r["step"], r["loss"], g["loss"])
    assert got[-1]["loss"] < got[0]["loss"] - 0.5
