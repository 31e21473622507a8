"""CUDA-only paths of the recipes (run by `nox -s gpu_tests` or scripts/gpu_check.sh; skipped without CUDA).

NCCL process groups and FSDP2Config's default bf16 mixed precision only run on GPUs; this launches
the CLI in a child process (torchrun for 2+ ranks) like a user would, never ranks forked from the
test process, on one GPU or two, and compares with the same config trained on CPU. megatron_fsdp through the recipes: test_gpu_megatron.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from automodel.mesh.testing import cuda_device_count

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402


def _run(tmp_path: Path, nproc: int, *, cpu: bool = False, **sections) -> list[dict]:
    """`recipes train` of the tiny config in a child process; its metrics records.

    ``cpu=True`` hides the GPUs from the child (gloo, fp32 CPU kernels): the reference run.
    """
    out = tmp_path / "run"
    cfg = tiny_config(str(out), step_scheduler={"max_steps": 8, "val_every_steps": None}, **sections)
    cfg.pop("validation_dataset")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "automodel.recipes.cli", "train", str(path), f"--nproc-per-node={nproc}"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if cpu else None
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


_FP32 = {"_target_": "torch.distributed.fsdp.MixedPrecisionPolicy"}  # no casts: full fp32


@pytest.mark.gpu
def test_fsdp2_on_gpus_matches_the_cpu_run_and_bf16_stays_close(tmp_path: Path) -> None:
    """fp32 on the GPUs reproduces the same config trained on CPU; the bf16 default policy follows it.

    Same model, data and seed: fp32 GPU losses within 1e-4 relative of the CPU run (different
    kernels, same math); the bf16 default (bf16 compute, fp32 reduction) within 5e-2 of fp32.
    """
    nproc = min(2, cuda_device_count())
    dist_fp32 = {"strategy": "fsdp2", "mp_policy": _FP32}
    cpu = _run(tmp_path / "cpu", 1, cpu=True, distributed=dist_fp32)
    fp32 = _run(tmp_path / "fp32", nproc, distributed=dist_fp32)
    bf16 = _run(tmp_path / "bf16", nproc, distributed={"strategy": "fsdp2"})
    for ref, got in zip(cpu, fp32, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (ref["step"], ref["loss"], got["loss"])
    for ref, got in zip(fp32, bf16, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=5e-2), (ref["step"], ref["loss"], got["loss"])
    assert bf16[-1]["loss"] < bf16[0]["loss"] - 0.5
    assert all(r["peak_mem_bytes"] > 0 for r in bf16)
