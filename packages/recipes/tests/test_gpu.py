"""CUDA-only paths of the recipes (run by `nox -s gpu_tests` or scripts/gpu_check.sh; skipped without CUDA).

NCCL process groups and FSDP2Config's default bf16 mixed precision only run on GPUs; this launches
the CLI in a child process (torchrun for 2+ ranks) like a user would, never ranks forked from the
test process, on one GPU or two. megatron_fsdp through the recipes: test_gpu_megatron.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from automodel.mesh.testing import cuda_device_count

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402


def _run(tmp_path: Path, nproc: int, **sections) -> list[dict]:
    out = tmp_path / "run"
    cfg = tiny_config(str(out), step_scheduler={"max_steps": 8, "val_every_steps": None}, **sections)
    cfg.pop("validation_dataset")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "automodel.recipes.cli", "train", str(path), f"--nproc-per-node={nproc}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.gpu
def test_fsdp2_bf16_default_policy_on_gpus(tmp_path: Path) -> None:
    nproc = min(2, cuda_device_count())
    records = _run(tmp_path, nproc, distributed={"strategy": "fsdp2"})
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert all(r["peak_mem_bytes"] > 0 for r in records)
