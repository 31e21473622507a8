"""CUDA-only paths of the recipes (run by `nox -s gpu_tests` or scripts/gpu_check.sh; skipped without CUDA).

NCCL process groups and FSDP2Config's default bf16 mixed precision only run on GPUs; this launches
the CLI in a child process (torchrun for 2+ ranks) like a user would, never ranks forked from the
test process, on one GPU or two, and compares with the same config trained on CPU. megatron_fsdp through the recipes: test_gpu_megatron.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from automodel.testing.ranks import cuda_device_count

sys.path.insert(0, str(Path(__file__).parent))
from _cli_run import CliRun  # noqa: E402
from _recipe_helpers import tiny_config  # noqa: E402

_FP32 = {"_target_": "torch.distributed.fsdp.MixedPrecisionPolicy"}  # no casts: full fp32


def _run(out: Path, nproc: int, *, cpu: bool = False, **sections: Any) -> CliRun:
    """`recipes train` of the tiny config, 8 steps, no validation."""
    cfg = tiny_config(str(out), step_scheduler={"max_steps": 8, "val_every_steps": None}, **sections)
    cfg.pop("validation_dataset")
    return CliRun(out, cfg, nproc, cpu=cpu)


def fsdp2_runs(tmp_path: Path, nproc: int) -> dict[str, CliRun]:
    """The runs of the test below: the CPU reference, fp32 and the bf16 default on `nproc` GPUs."""
    dist_fp32 = {"strategy": "fsdp2", "mp_policy": _FP32}
    return {
        "cpu": _run(tmp_path / "cpu", 1, cpu=True, distributed=dist_fp32),
        "fp32": _run(tmp_path / "fp32", nproc, distributed=dist_fp32),
        "bf16": _run(tmp_path / "bf16", nproc, distributed={"strategy": "fsdp2"}),
    }


@pytest.mark.gpu
def test_fsdp2_on_gpus_matches_the_cpu_run_and_bf16_stays_close(tmp_path: Path) -> None:
    """fp32 on the GPUs reproduces the same config trained on CPU; the bf16 default policy follows it.

    Same model, data and seed: fp32 GPU losses within 1e-4 relative of the CPU run (different
    kernels, same math); the bf16 default (bf16 compute, fp32 reduction) within 5e-2 of fp32.
    """
    runs = fsdp2_runs(tmp_path, min(2, cuda_device_count()))
    cpu, fp32, bf16 = (runs[name].launch() for name in ("cpu", "fp32", "bf16"))
    for ref, got in zip(cpu, fp32, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (ref["step"], ref["loss"], got["loss"])
    for ref, got in zip(fp32, bf16, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=5e-2), (ref["step"], ref["loss"], got["loss"])
    assert bf16[-1]["loss"] < bf16[0]["loss"] - 0.5
    assert all(r["peak_mem_bytes"] > 0 for r in bf16)


def async_checkpoint_runs(tmp_path: Path, *, cpu: bool = False) -> dict[str, CliRun]:
    """8 steps with an async save every 4, and a run resumed from its step 4 (``restore_from``)."""

    def config(out: Path, **checkpoint: Any) -> dict[str, Any]:
        cfg = tiny_config(
            str(out),
            step_scheduler={"max_steps": 8, "val_every_steps": None, "ckpt_every_steps": 4},
            checkpoint={"enabled": True, "is_async": True, **checkpoint},
        )
        cfg.pop("validation_dataset")
        return cfg

    step_4 = tmp_path / "straight" / "checkpoints" / "step_4"
    return {
        "straight": CliRun(tmp_path / "straight", config(tmp_path / "straight"), 1, cpu=cpu),
        "resumed": CliRun(
            tmp_path / "resumed", config(tmp_path / "resumed", restore_from=str(step_4)), 1, cpu=cpu
        ),
    }


def check_async_checkpoint_runs(runs: dict[str, CliRun], *, pinned: bool) -> None:
    """The staging line says which host memory was used; the resume reproduces steps 5-8."""
    straight, stderr = runs["straight"].launch_with_stderr()
    assert ("pinned host memory" in stderr) == pinned, stderr[-2000:]
    assert (runs["straight"].out / "checkpoints" / "LATEST").read_text().strip() == "step_8"
    resumed = runs["resumed"].launch()
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    for ref, got in zip([r for r in straight if r["step"] > 4], resumed, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), (ref["step"], ref["loss"], got["loss"])


@pytest.mark.gpu
def test_async_checkpoint_on_one_gpu_stages_pinned_and_resumes(tmp_path: Path) -> None:
    """``checkpoint.is_async`` with a CUDA device: staged in pinned host memory (non-blocking copies),
    written in the background, and a resume from an async save reproduces the straight run."""
    check_async_checkpoint_runs(async_checkpoint_runs(tmp_path), pinned=True)
