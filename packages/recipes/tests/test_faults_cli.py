"""Faults around the `recipes train` command itself (2 gloo ranks under the launcher): nothing lost,
nothing hangs, nothing silent.

In the CPU suite: SIGTERM on a checkpoint step; an error inside the ranks reaches the user as one
line. `nox -s faults` runs every case (``AUTOMODEL_FAULTS=all``), among them a SIGKILLed launcher
taking every rank with it while the next run takes over its lock and resumes with one metrics
record per step.
"""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch.distributed.checkpoint.metadata import Metadata

from automodel.recipes.lifetime import descendants_of, is_alive

TESTS_DIR = Path(__file__).parent
sys.path.insert(0, str(TESTS_DIR))
from _launch_helpers import clean_env  # noqa: E402
from _recipe_helpers import tiny_config  # noqa: E402

from automodel.testing.faults import full_only  # noqa: E402


def _write_config(tmp: Path, **sections: Any) -> Path:
    cfg = tiny_config(
        str(tmp / "run"),
        step_scheduler={"max_steps": 400, "val_every_steps": None, "ckpt_every_steps": 2},
        validation_dataset=None,
        checkpoint={"enabled": True},
    )
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _start(config: Path, tmp: Path, *extra: str, name: str = "launcher") -> tuple[subprocess.Popen, Path]:
    err = tmp / f"{name}.stderr"
    cmd = [
        sys.executable,
        "-m",
        "automodel.recipes.cli",
        "train",
        str(config),
        "--nproc-per-node",
        "2",
        *extra,
    ]
    with open(err, "w") as f:  # a file: a full pipe would stall the job
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env=clean_env(), cwd=tmp)
    return proc, err


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _wait_for_steps(proc: subprocess.Popen, run: Path, steps: int, err: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(_metrics(run)) < steps:
        assert proc.poll() is None, f"the run ended early ({proc.returncode}):\n{err.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no step {steps} after {timeout} s:\n{err.read_text()[-3000:]}"
        time.sleep(0.2)


def _wait_dead(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if is_alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if is_alive(p)]


@full_only  # ~40 s on 2 cores; the CPU suite keeps the SIGTERM and rank-error cases
def test_killed_launcher_takes_its_ranks_and_the_next_run_resumes(tmp_path):
    """SIGKILL of the launcher (only): no rank alive 10 s later. The next run takes over the stale
    lock, says where it resumes from, and metrics.jsonl ends with one record per step."""
    config = _write_config(tmp_path)
    run = tmp_path / "run"
    proc, err = _start(config, tmp_path)
    try:
        _wait_for_steps(proc, run, 5, err)
        tree = descendants_of(proc.pid)
        assert len(tree) >= 3, tree  # torchrun's agent and two ranks
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    alive = _wait_dead(tree, 10)
    assert not alive, f"still running 10 s after the launcher was killed: {alive}"
    latest = int((run / "checkpoints" / "LATEST").read_text().strip().removeprefix("step_"))
    done = latest + 2
    proc2, err2 = _start(config, tmp_path, f"--step_scheduler.max_steps={done}", name="resume")
    assert proc2.wait(timeout=300) == 0, err2.read_text()[-3000:]
    text = err2.read_text()
    assert "taking over the stale lock of" in text and f"(pid {proc.pid} on host" in text
    assert f"resumed from step {latest} (" in text
    assert [r["step"] for r in _metrics(run)] == list(range(1, done + 1))


def test_sigterm_on_a_checkpoint_step_saves_announces_and_waits(tmp_path):
    """SIGTERM to the launcher, every step a checkpoint step: the ranks save and stop, the pre-emption
    line is printed once, and the launcher returns (143) only after every rank has exited."""
    config = _write_config(tmp_path, step_scheduler={"ckpt_every_steps": 1})
    run = tmp_path / "run"
    proc, err = _start(config, tmp_path)
    try:
        _wait_for_steps(proc, run, 3, err)
        tree = descendants_of(proc.pid)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [p for p in tree if is_alive(p)] == []  # nothing outlives the command
    text = err.read_text()
    assert code == 128 + signal.SIGTERM, text[-3000:]
    assert text.count("SIGTERM received (pre-emption): saved checkpoint") == 1, text[-3000:]
    steps = [r["step"] for r in _metrics(run)]
    assert (run / "checkpoints" / "LATEST").read_text().strip() == f"step_{steps[-1]}"
    assert "Traceback" not in text


def test_rank_error_is_one_line_with_exit_2(tmp_path):
    """A checkpoint that cannot be loaded, found inside the ranks: one line naming it, exit 2, the
    traceback in a log file; no torchrun dump and no traceback on the terminal. (Garbage DCP metadata
    is refused before launch, test_faults_refusals.py: this one's metadata is valid DCP metadata of
    an empty state, which only the ranks find lacks their entries.)"""
    bad = tmp_path / "corrupt_step_1"  # complete by its sizes
    bad.mkdir()
    metadata = pickle.dumps(Metadata(state_dict_metadata={}))
    (bad / ".metadata").write_bytes(metadata)
    (bad / "checkpoint.json").write_text(json.dumps({"step": 1, "files": {".metadata": len(metadata)}}))
    config = _write_config(tmp_path, step_scheduler={"max_steps": 2}, checkpoint={"restore_from": str(bad)})
    proc, err = _start(config, tmp_path)
    code = proc.wait(timeout=300)
    text = err.read_text()
    assert code == 2, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0], text[-3000:]
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]
    logs = sorted((tmp_path / "run" / "logs").glob("rank_*.error.log"))
    assert logs and "Traceback" in logs[0].read_text()


@full_only  # the lock's refusal itself: test_run_safety.py in the CPU suite
def test_busy_output_dir_is_refused_before_launch(tmp_path):
    """A second run on a directory in use: exit 2 naming the holder, before any rank starts."""
    config = _write_config(tmp_path)
    run = tmp_path / "run"
    first, err = _start(config, tmp_path)
    try:
        _wait_for_steps(first, run, 1, err)
        second = subprocess.run(
            [sys.executable, "-m", "automodel.recipes.cli", "train", str(config), "--nproc-per-node", "2"],
            capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=120,
        )  # fmt: skip
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"is in use by another run: pid {first.pid} on host" in second.stderr
    assert "fresh start" not in second.stderr and "resumed" not in second.stderr


@full_only
def test_changed_config_stops_with_differences(tmp_path):
    config = _write_config(tmp_path, step_scheduler={"max_steps": 2})
    proc, err = _start(config, tmp_path)
    assert proc.wait(timeout=300) == 0, err.read_text()[-3000:]
    changed = subprocess.run(
        [sys.executable, "-m", "automodel.recipes.cli", "train", str(config), "--optimizer.lr=0.03"],
        capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert changed.returncode == 2
    assert "optimizer.lr: 0.003 -> 0.03" in changed.stderr and "--resume-with-changes" in changed.stderr


@full_only
def test_disk_full_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """output_dir on a 4 MiB tmpfs: a save fails with ENOSPC inside the ranks -> one line naming the
    file, exit 2; the last complete checkpoint and LATEST are untouched."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4M", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        config = _write_config(
            tmp_path, output_dir=str(mnt / "run"), step_scheduler={"max_steps": 40, "ckpt_every_steps": 1}
        )
        proc, err = _start(config, tmp_path)
        code = proc.wait(timeout=300)
        text = err.read_text()
        assert code == 2, text[-3000:]
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "No space left on device" in errors[0] and "(ENOSPC)" in errors[0], text[
            -3000:
        ]
        assert "Traceback" not in text
        from automodel.recipes.checkpoint.paths import check_complete

        ckpts = mnt / "run" / "checkpoints"
        check_complete(ckpts / (ckpts / "LATEST").read_text().strip())
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_single_process_run_holds_its_own_lock_and_resumes(tmp_path):
    """`recipes train` without --nproc-per-node trains in the launcher itself, which holds the lock:
    the trainer finds it held by its own process. A second run resumes and says so."""
    config = _write_config(tmp_path, step_scheduler={"max_steps": 2})
    cmd = [sys.executable, "-m", "automodel.recipes.cli", "train", str(config)]
    first = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "fresh start" in first.stderr
    again = subprocess.run(
        [*cmd, "--step_scheduler.max_steps=3"], capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=300
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step 2 ({tmp_path / 'run' / 'checkpoints' / 'step_2'})" in again.stderr
    assert [r["step"] for r in _metrics(tmp_path / "run")] == [1, 2, 3]
