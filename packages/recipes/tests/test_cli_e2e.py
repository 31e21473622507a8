"""End to end through the console-script code path and torch's launcher (torchrun): slow, few."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402

from automodel.recipes.metrics import REQUIRED_KEYS  # noqa: E402

STEPS = 8


def _train(tmp_path: Path, nproc: int, **sections) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "run"
    cfg = tiny_config(
        str(out),
        step_scheduler={"max_steps": STEPS, "val_every_steps": 4},
        validation_dataset={"source": "embedded", "seq_length": 32, "max_bytes": 20000},
        **sections,
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "automodel.recipes.cli", "train", str(path), f"--nproc-per-node={nproc}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    return proc, out


def _check_metrics(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert all(k in r and r[k] is not None for k in REQUIRED_KEYS), r
        assert r["num_tokens"] == 8 * 32
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8]
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 0.5, (first, last)
    return records


@pytest.mark.slow
def test_train_2_ranks_fsdp2_with_checkpoint_and_plot(tmp_path: Path) -> None:
    proc, out = _train(tmp_path, 2, checkpoint={"enabled": True, "save_consolidated": True})
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_metrics(out)
    assert yaml.safe_load((out / "config.yaml").read_text())["output_dir"] == str(out)
    configs = sorted((out / "checkpoints").rglob("config.json"))
    assert configs, list((out / "checkpoints").rglob("*"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(configs[-1].parent)
    assert model.config.num_hidden_layers == 2
    plot = subprocess.run(
        [sys.executable, "-m", "automodel.recipes.cli", "plot", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plot.returncode == 0, plot.stderr
    png = out / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_train_4_ranks_fsdp2_x_tp(tmp_path: Path) -> None:
    proc, out = _train(tmp_path, 4, distributed={"strategy": "fsdp2", "tp_size": 2})
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_metrics(out)
    # every rank says, read off its own parameters, what it holds: one line per parallelism
    for rank in range(4):
        assert f"[rank {rank}] tp (2 ranks): " in proc.stderr, proc.stderr[-3000:]
        assert f"[rank {rank}] dp_shard_cp (2 ranks): " in proc.stderr, proc.stderr[-3000:]
        assert f"[rank {rank}] fsdp2: 3 units" in proc.stderr, proc.stderr[-3000:]
