"""End-to-end resume and faults through the recipes loop (real gloo ranks) and `recipes train`.

Faults are injected by `test_faults_hooks.FaultyAdamW`, named as the YAML's optimizer
``_target_``: SIGKILL of one rank under ``--max-restarts 1``, SIGTERM, a hung rank, a NaN weight.
The SIGKILL, async-save and hung-rank cases run in `nox -s faults` (``AUTOMODEL_FAULTS=all``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from automodel.recipes.checkpoint.paths import check_complete
from automodel.testing.faults import full_only
from automodel.testing.ranks import RankFailure, run_on_ranks

TESTS_DIR = Path(__file__).parent
sys.path.insert(0, str(TESTS_DIR))  # test_faults_hooks (the optimizer _target_) and _recipe_helpers
from _recipe_helpers import TINY  # noqa: E402

TIMEOUT = 300
HOOK = "test_faults_hooks.FaultyAdamW"

BASE: dict[str, Any] = {
    "seed": 11,
    "model": copy.deepcopy(TINY["model"]),
    "dataset": {"source": "embedded", "seq_length": 32, "max_bytes": 40000},
    "step_scheduler": {"global_batch_size": 8, "local_batch_size": 4, "max_steps": 10, "ckpt_every_steps": 5},
    "optimizer": {"_target_": HOOK, "lr": 0.003, "foreach": False},
    "lr_scheduler": {"warmup_steps": 2, "decay_style": "cosine", "min_lr": 0.0003},
    "distributed": {"strategy": "fsdp2"},
    "checkpoint": {"enabled": True, "save_consolidated": True},
    "logging": {"progress_bar": False},
}


def _config(output_dir: Path, **sections: dict) -> dict[str, Any]:
    cfg = copy.deepcopy(BASE)
    cfg["output_dir"] = str(output_dir)
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def _train(raw: dict[str, Any]) -> dict[str, Any]:
    """Rank body: the recipes loop on this config."""
    from automodel.recipes import load_config
    from automodel.recipes.trainer import run_training

    result = run_training(load_config(raw))
    return {"losses": result.losses, "steps": result.steps}


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "consolidated" / "model.safetensors"))


def _cli(
    cfg: dict[str, Any], tmp: Path, *extra: str, timeout: float = TIMEOUT
) -> subprocess.CompletedProcess:
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "automodel.recipes.cli", "train", str(path), "--nproc-per-node", "2", *extra]
    return subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """10 uninterrupted steps on FSDP2 dp=2, checkpoints at 5 and 10 (consolidated)."""
    out = tmp_path_factory.mktemp("straight")
    res = run_on_ranks(_train, world_size=2, args=(_config(out),), timeout_s=TIMEOUT)
    assert res[0]["steps"] == 10
    return out, res[0]["losses"]


def test_resume_through_loop_is_bitwise(straight, tmp_path):
    """5 + resume 5 (the run stopped after step_5 was saved) == 10 straight: losses and final weights."""
    ref_dir, ref_losses = straight
    run = tmp_path / "run"
    shutil.copytree(ref_dir / "checkpoints" / "step_5", run / "checkpoints" / "step_5")
    res = run_on_ranks(_train, world_size=2, args=(_config(run),), timeout_s=TIMEOUT)
    assert res[0]["losses"] == ref_losses[5:]  # bitwise
    got, ref = _weights(run, 10), _weights(ref_dir, 10)
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def _corrupt_copy(straight_dir: Path, run: Path) -> Path:
    """step_5 and step_10 copied into `run`; one shard of step_10 overwritten by same-size garbage."""
    for step in (5, 10):
        shutil.copytree(straight_dir / "checkpoints" / f"step_{step}", run / "checkpoints" / f"step_{step}")
    shard = sorted((run / "checkpoints" / "step_10").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    return shard


def test_corrupt_latest_checkpoint_names_the_file(straight, tmp_path):
    """Same size, other bytes: the checksum names the shard and the checkpoint to resume from instead."""
    ref_dir, _ = straight
    run = tmp_path / "run"
    shard = _corrupt_copy(ref_dir, run)
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_train, world_size=2, args=(_config(run),), timeout_s=TIMEOUT)
    message = str(info.value)
    assert f"checkpoint {run / 'checkpoints' / 'step_10'} is corrupt: {shard}: sha256" in message
    assert f"The previous complete checkpoint is {run / 'checkpoints' / 'step_5'}" in message


def test_corrupt_latest_checkpoint_falls_back_when_configured(straight, tmp_path, capfd):
    """checkpoint.on_corrupt: previous -> resumes from step_5, saying why; steps 6-10 bitwise as straight."""
    ref_dir, ref_losses = straight
    run = tmp_path / "run"
    _corrupt_copy(ref_dir, run)
    cfg = _config(run, checkpoint={"on_corrupt": "previous", "save_consolidated": False})
    res = run_on_ranks(_train, world_size=2, args=(cfg,), timeout_s=TIMEOUT)
    assert res[0]["losses"] == ref_losses[5:]
    err = capfd.readouterr().err
    assert (
        "step_10 is corrupt" in err
        and f"resuming from the previous complete checkpoint {run / 'checkpoints' / 'step_5'}" in err
    )


@pytest.mark.parametrize("fault", ["shard_of_another_step", "truncated_shard", "missing_shard"])
def test_every_checkpoint_load_error_names_the_file(straight, tmp_path, fault):
    """A shard copied in from another step used to end in a bare JSONDecodeError naming no file; a
    truncated or missing one in tracebacks. Each now names the checkpoint and the file."""
    from automodel.recipes.checkpoint import integrity
    from automodel.recipes.checkpoint.paths import CheckpointError

    ref_dir, _ = straight
    root = tmp_path / "checkpoints"
    for step in (5, 10):
        shutil.copytree(ref_dir / "checkpoints" / f"step_{step}", root / f"step_{step}")
    shard = sorted((root / "step_10").glob("*.distcp"))[0]
    if fault == "shard_of_another_step":
        shutil.copyfile(root / "step_5" / shard.name, shard)
    elif fault == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        shard.unlink()
    with pytest.raises(CheckpointError) as info:
        integrity.verified(root / "step_10", root=root, on_corrupt="error", explicit=False)
    assert str(root / "step_10") in str(info.value) and shard.name in str(info.value), str(info.value)


def test_resume_under_another_layout(straight, tmp_path):
    """Saved by FSDP2 dp=2, resumed with TP=2: steps 6-10 match the straight run to 1e-5."""
    ref_dir, ref_losses = straight
    run = tmp_path / "run"
    shutil.copytree(ref_dir / "checkpoints" / "step_5", run / "checkpoints" / "step_5")
    cfg = _config(
        run, distributed={"strategy": "fsdp2", "tp_size": 2}, checkpoint={"save_consolidated": False}
    )
    res = run_on_ranks(_train, world_size=2, args=(cfg,), timeout_s=TIMEOUT)
    assert len(res[0]["losses"]) == 5
    for got, ref in zip(res[0]["losses"], ref_losses[5:]):
        assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)


def test_nan_stops_with_step_and_keeps_last_good_checkpoint(tmp_path):
    cfg = _config(
        tmp_path,
        optimizer={"fault": "nan", "at_step": 3, "on_rank": 0},
        step_scheduler={"ckpt_every_steps": 2},
        checkpoint={"save_consolidated": False},
    )
    with pytest.raises(RankFailure, match="step 4: non-finite loss"):
        run_on_ranks(_train, world_size=2, args=(cfg,), timeout_s=TIMEOUT)
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "LATEST").read_text().strip() == "step_2"
    assert sorted(p.name for p in ckpts.iterdir()) == ["LATEST", "step_2"]
    check_complete(ckpts / "step_2")


def test_sigterm_saves_and_exits_with_message(tmp_path, capfd):
    cfg = _config(
        tmp_path,
        optimizer={"fault": "sigterm", "at_step": 3, "on_rank": 1},
        checkpoint={"save_consolidated": False},
    )
    res = run_on_ranks(_train, world_size=2, args=(cfg,), timeout_s=TIMEOUT)
    assert [r["steps"] for r in res] == [3, 3]
    assert "SIGTERM received (pre-emption): saved checkpoint" in capfd.readouterr().err
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "LATEST").read_text().strip() == "step_3"
    check_complete(ckpts / "step_3")
    # Running again resumes at step 3 and finishes the schedule.
    cfg["optimizer"].pop("fault")
    res = run_on_ranks(_train, world_size=2, args=(cfg,), timeout_s=TIMEOUT)
    assert res[0]["steps"] == 10 and len(res[0]["losses"]) == 7
    assert f"resumed from step 3 ({ckpts / 'step_3'})" in capfd.readouterr().err
    # One record per step: the records of the first run past step 3 (none here) would be dropped.
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))


@full_only  # ~30 s on 2 cores: a fault-suite case (`nox -s faults`)
def test_sigkill_of_a_rank_restarts_and_matches(straight, tmp_path):
    """`recipes train --max-restarts`: rank 1 is SIGKILLed at step 7; torchrun restarts from step_5."""
    ref_dir, _ = straight
    cfg = _config(tmp_path / "run", optimizer={"fault": "sigkill", "at_step": 7, "on_rank": 1})
    # One restart is what the fault needs; the spare one absorbs a torch-elastic race seen under heavy
    # load, where the restarted ranks' gloo init reads the dead generation's address from the store
    # ("connectFullMesh ... Connection refused"). The hook kills only on the first launch.
    proc = _cli(cfg, tmp_path, "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step_10" == (tmp_path / "run" / "checkpoints" / "LATEST").read_text().strip()
    got, ref = _weights(tmp_path / "run", 10), _weights(ref_dir, 10)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_async_saves_match_the_sync_run_and_resume_bitwise(straight, tmp_path):
    """checkpoint.is_async: losses and step_10's consolidated export equal the sync run's; its
    step_5 (written in the background) resumes to the same last 5 losses and weights."""
    ref_dir, ref_losses = straight
    run = tmp_path / "run"
    res = run_on_ranks(
        _train, world_size=2, args=(_config(run, checkpoint={"is_async": True}),), timeout_s=TIMEOUT
    )
    assert res[0]["losses"] == ref_losses
    ckpts = run / "checkpoints"
    assert (ckpts / "LATEST").read_text().strip() == "step_10"
    assert sorted(p.name for p in ckpts.iterdir()) == ["LATEST", "step_10", "step_5"]  # no .tmp- left
    for step in (5, 10):
        assert check_complete(ckpts / f"step_{step}")["sha256"]  # checksums written after the write
        got, ref = _weights(run, step), _weights(ref_dir, step)
        for name in ref:
            assert torch.equal(got[name], ref[name]), (step, name)
    resumed = tmp_path / "resumed"
    shutil.copytree(ckpts / "step_5", resumed / "checkpoints" / "step_5")
    res = run_on_ranks(
        _train, world_size=2, args=(_config(resumed, checkpoint={"is_async": True}),), timeout_s=TIMEOUT
    )
    assert res[0]["losses"] == ref_losses[5:]
    got, ref = _weights(resumed, 10), _weights(ref_dir, 10)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


@full_only  # ~40 s on 2 cores: a fault-suite case (`nox -s faults`)
def test_sigkill_during_an_async_save_resumes_from_the_previous_one(straight, tmp_path):
    """`recipes train --max-restarts 1`, is_async, saves every 3 steps, each shard write held 2 s on
    the first launch: rank 1 is SIGKILLed at step 7 while step_6 is being written. The restart
    drops the unfinished .tmp-step_6, resumes from step_3, and steps 4-10 match the straight run."""
    ref_dir, ref_losses = straight
    run = tmp_path / "run"
    cfg = _config(
        run,
        optimizer={"fault": "sigkill", "at_step": 7, "on_rank": 1, "slow_save_s": 2.0},
        step_scheduler={"ckpt_every_steps": 3},
        checkpoint={"is_async": True},
    )
    proc = _cli(cfg, tmp_path, "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ordinary (non-pinned) host memory" in proc.stderr or "pinned host memory" in proc.stderr
    assert f"removing {run / 'checkpoints' / '.tmp-step_6'} left by an interrupted save" in proc.stderr
    assert f"resumed from step 3 ({run / 'checkpoints' / 'step_3'})" in proc.stderr
    assert "step_10" == (run / "checkpoints" / "LATEST").read_text().strip()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["loss"] for r in records][3:] == ref_losses[3:]  # steps 4-10: the resumed run's, bitwise
    got, ref = _weights(run, 10), _weights(ref_dir, 10)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


@full_only  # ~30 s on 2 cores: a fault-suite case (`nox -s faults`)
def test_hung_rank_fails_with_timeout(tmp_path):
    """Rank 1 hangs at step 2; rank 0 fails within dist_env.timeout_minutes (6 s), not in 600 s."""
    cfg = _config(
        tmp_path / "run",
        optimizer={"fault": "hang", "at_step": 2, "on_rank": 1},
        checkpoint={"enabled": False},
        step_scheduler={"ckpt_every_steps": None},
        dist_env={"timeout_minutes": 0.1},
    )
    started = time.monotonic()
    proc = _cli(cfg, tmp_path, timeout=240)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert "CollectiveTimeoutError: rank 0, step 3: a collective timed out" in proc.stderr, proc.stderr[
        -4000:
    ]
    assert "dist_env.timeout_minutes=0.1" in proc.stderr
    assert elapsed < 180, elapsed
