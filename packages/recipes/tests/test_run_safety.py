"""The pieces that keep a run from losing or silently mixing work, each checked on its own (no ranks):
the output_dir lock, the config-change check of a resume, metrics.jsonl truncation, the one-line
reports of failed ranks, and the parent-death signal. End-to-end cases are in test_faults_cli.py.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from automodel.recipes.errors import ConfigError, DataError

sys.path.insert(0, str(Path(__file__).parent))  # _recipe_helpers
from automodel.recipes.metrics import truncate_metrics
from automodel.recipes.rank_errors import RankReport, classify, report_failure, summarize
from automodel.recipes.resume_check import check_config_changes, config_differences
from automodel.recipes.run_lock import acquire_output_lock, acquire_run_lock

HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from automodel.recipes.run_lock import acquire_output_lock
    lock = acquire_output_lock(sys.argv[1])
    print("held", flush=True)
    time.sleep(120)
    """
)


def _holder(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_lock_refuses_a_second_run_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    proc = _holder(out)
    try:
        with pytest.raises(ConfigError, match=rf"is in use by another run: pid {proc.pid} on host .*started"):
            acquire_output_lock(out)
    finally:
        proc.kill()
        proc.wait()


def test_lock_of_a_dead_holder_is_taken_over_with_a_line(tmp_path, capsys):
    out = tmp_path / "run"
    proc = _holder(out)
    proc.kill()  # SIGKILL: the holder never cleans up its lock file
    proc.wait()
    lock = acquire_output_lock(out)
    assert lock is not None
    err = capsys.readouterr().err
    assert f"taking over the stale lock of {out}: its holder (pid {proc.pid}" in err
    assert "is no longer running" in err
    assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert (out / ".lock").read_text() == ""  # a clean release leaves nothing to take over
    again = acquire_output_lock(out)
    assert again is not None and "taking over" not in capsys.readouterr().err
    again.release()


def test_lock_held_by_an_ancestor_is_ours(tmp_path):
    """A rank under the `recipes` launcher finds the lock held by its launcher: it goes on."""
    out = tmp_path / "run"
    lock = acquire_output_lock(out)
    code = (
        "import sys; from automodel.recipes.run_lock import acquire_output_lock as a; print(a(sys.argv[1]))"
    )
    child = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "None"
    lock.release()


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "out"
    f.write_text("x")
    with pytest.raises(ConfigError, match="output_dir=.*: is a file, not a directory"):
        acquire_output_lock(f)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_dir_is_refused(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="output_dir=.*: is not writable"):
            acquire_output_lock(out)
    finally:
        out.chmod(0o755)


HOLD_RUN_LOCK = textwrap.dedent(
    """
    import sys, time
    from automodel.recipes.run_lock import acquire_run_lock
    lock = acquire_run_lock(output_dir=sys.argv[1], checkpoint_dir=sys.argv[2])
    print("held", flush=True)
    time.sleep(120)
    """
)


def _run_holder(out: Path, ckpt: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_RUN_LOCK, str(out), str(ckpt)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize(
    ("first", "second", "says"),
    [
        # two runs, different output_dirs, one checkpoint_dir outside both
        (
            ("a", "ckpt"),
            ("b", "ckpt"),
            r"checkpoint.checkpoint_dir='.*ckpt': is in use by another run: pid {pid} ",
        ),
        # the second run's checkpoint_dir is the first run's own (default) checkpoints directory
        (
            ("a", "a/checkpoints"),
            ("b", "a/checkpoints"),
            r"checkpoint.checkpoint_dir='.*a/checkpoints': is inside .*/a, the output_dir of another run: pid {pid} ",
        ),
        # the other way round: a run whose default checkpoints directory another run holds
        (
            ("b", "a/checkpoints"),
            ("a", "a/checkpoints"),
            r"checkpoint.checkpoint_dir='.*a/checkpoints': is the checkpoint_dir of another run: pid {pid} ",
        ),
        # a checkpoint_dir that is another run's output_dir
        (
            ("a", "a/checkpoints"),
            ("b", "a"),
            r"checkpoint.checkpoint_dir='.*/a': is in use by another run: pid {pid} ",
        ),
    ],
    ids=["shared_outside", "inside_other_output", "held_as_outside", "other_output_dir"],
)
def test_shared_checkpoint_dir_is_refused_naming_the_holder(tmp_path, first, second, says):
    proc = _run_holder(tmp_path / first[0], tmp_path / first[1])
    try:
        with pytest.raises(ConfigError, match=says.format(pid=proc.pid)):
            acquire_run_lock(output_dir=tmp_path / second[0], checkpoint_dir=tmp_path / second[1])
        # the refused run let go of its own output_dir again
        mine = acquire_output_lock(tmp_path / second[0])
        assert mine is not None
        mine.release()
    finally:
        proc.kill()
        proc.wait()
    lock = acquire_run_lock(output_dir=tmp_path / second[0], checkpoint_dir=tmp_path / second[1])
    assert len(lock.locks) == (1 if second[1].startswith(second[0] + "/") else 2)
    lock.release()


@pytest.mark.parametrize("shared", ["output_dir", "checkpoint_dir"])
def test_a_second_run_is_refused_and_leaves_the_live_runs_tmp_alone(tmp_path, capsys, shared):
    """`recipes train` on the output_dir, or only the checkpoint_dir, of a live run: exit 2, one line
    naming the key and the holder, before any rank starts; the live run's ``.tmp-step_N`` (a save
    in progress) is not touched, and nothing is written."""
    from _recipe_helpers import tiny_config

    from automodel.recipes.cli import run_cli

    ckpt = tmp_path / "ckpt"
    proc = _run_holder(tmp_path / "a", ckpt)
    in_progress = ckpt / ".tmp-step_7"
    in_progress.mkdir(parents=True)
    (in_progress / "shard.distcp").write_bytes(b"half written")
    try:
        out = tmp_path / ("a" if shared == "output_dir" else "b")
        cfg = tiny_config(str(out), checkpoint={"enabled": True, "checkpoint_dir": str(ckpt)})
        (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
        assert run_cli(["train", str(tmp_path / "cfg.yaml"), "--nproc-per-node=2"]) == 2
    finally:
        proc.kill()
        proc.wait()
    (line,) = capsys.readouterr().err.strip().splitlines()
    key = "output_dir" if shared == "output_dir" else "checkpoint.checkpoint_dir"
    assert line.startswith(f"error: {key}=") and f"in use by another run: pid {proc.pid}" in line, line
    assert (in_progress / "shard.distcp").read_bytes() == b"half written"
    assert not (out / "metrics.jsonl").exists() and not (out / "config.yaml").exists()


def _cfg(out: Path, lr: float, max_steps: int = 5) -> SimpleNamespace:
    raw = {"output_dir": str(out), "optimizer": {"lr": lr}, "step_scheduler": {"max_steps": max_steps}}
    return SimpleNamespace(output_dir=str(out), raw=raw)


def test_changed_config_is_refused_listing_differences(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(_cfg(tmp_path, 0.003).raw))
    assert check_config_changes(_cfg(tmp_path, 0.003, max_steps=50), allow_changes=False) == []
    with pytest.raises(
        ConfigError, match=r"Differences: optimizer\.lr: 0\.003 -> 0\.03\. Pass --resume-with"
    ):
        check_config_changes(_cfg(tmp_path, 0.03), allow_changes=False)


def test_resume_with_changes_keeps_the_old_config(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(_cfg(tmp_path, 0.003).raw))
    assert check_config_changes(_cfg(tmp_path, 0.03), allow_changes=True) == ["optimizer.lr: 0.003 -> 0.03"]
    assert "resuming" in capsys.readouterr().err
    (backup,) = tmp_path.glob("config.*.yaml")
    assert yaml.safe_load(backup.read_text())["optimizer"]["lr"] == 0.003
    assert not (tmp_path / "config.yaml").exists()  # the run writes the new one


def test_config_differences_added_and_removed_keys():
    assert config_differences({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}) == ["a.c: (absent) -> 2"]
    assert config_differences({"logging": {"x": 1}, "seed": 1}, {"seed": 2}) == ["seed: 1 -> 2"]


def test_metrics_truncated_to_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in range(1, 8)]
    path.write_text("\n".join(lines) + '\n{"step": 8, "lo')  # torn last line
    truncate_metrics(path, keep_through_step=5)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    truncate_metrics(path, keep_through_step=0)  # a fresh start
    assert path.read_text() == ""


def test_classify_one_line_errors():
    from automodel.recipes.checkpoint.paths import CheckpointError

    assert classify(ConfigError("optimizer.lr", -1, "must be > 0")) == (2, "optimizer.lr=-1: must be > 0")
    assert classify(DataError("data.jsonl line 3: not JSON")) == (2, "data.jsonl line 3: not JSON")
    disk = OSError(errno.ENOSPC, "No space left on device", "/out/x.distcp")
    try:
        try:
            raise disk
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as wrapped:
        assert classify(wrapped) == (2, "No space left on device: /out/x.distcp (ENOSPC)")
    assert classify(CheckpointError("checkpoint /c/step_9 does not exist"))[0] == 2
    assert classify(KeyError("x")) == (1, "")


def test_report_and_summary(tmp_path):
    out = tmp_path / "out"
    try:
        raise ConfigError("checkpoint.restore_from", "step_99", "does not exist")
    except ConfigError as e:
        report = report_failure(e, rank=1, output_dir=str(out), error_dir=str(tmp_path))
    assert Path(report.traceback_file) == out / "logs" / "rank_1.error.log"
    assert "Traceback" in Path(report.traceback_file).read_text()
    peer = RankReport(
        rank=0, exit_code=1, line="", error="RuntimeError: Connection closed by peer", traceback_file="t",
        time=report.time + 1,
    )  # fmt: skip
    code, lines = summarize([report, peer])
    assert code == 2
    assert lines[0] == "error: checkpoint.restore_from='step_99': does not exist"
    assert lines[1].startswith("  (rank 1; full traceback:")


GRANDCHILD = """
import os, time
from automodel.recipes.lifetime import die_with_parent
die_with_parent(expected_parent=os.getppid())
print(os.getpid(), flush=True)
time.sleep(120)
"""

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(120)
"""


def test_die_with_parent():
    """A child in a session of its own (as torchrun starts ranks) dies when its parent is SIGKILLed."""
    from automodel.recipes.lifetime import is_alive

    parent = subprocess.Popen([sys.executable, "-c", PARENT, GRANDCHILD], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert is_alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while is_alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_alive(child)


def test_stale_tmp_symlink_is_removed_not_its_target(tmp_path):
    """A leftover ``.tmp-step_N`` that is a symlink: the link goes, the directory it points to stays."""
    from automodel.recipes.checkpoint.paths import remove_stale

    root, target = tmp_path / "checkpoints", tmp_path / "elsewhere"
    root.mkdir()
    target.mkdir()
    (target / "keep.txt").write_text("x")
    (root / ".tmp-step_5").symlink_to(target, target_is_directory=True)
    remove_stale(root)
    assert not (root / ".tmp-step_5").exists() and not (root / ".tmp-step_5").is_symlink()
    assert (target / "keep.txt").read_text() == "x"


BAD_ROWS = [
    ("non_utf8", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', ":2: not UTF-8 (byte 0xe9 at column"),
    ("malformed", b'{"text": "ok"}\n{"text": "ok"}\n{"text": \n', ":3: malformed JSON (Expecting value"),
    ("wrong_type", b'{"text": "ok"}\n{"text": 3}\n', ":2: column 'text' holds int 3, not text"),
    ("not_object", b'{"text": "ok"}\n[1, 2]\n', ":2: a row must be a JSON object, got list"),
    ("empty", b"\n\n", " holds no rows (an empty file)"),
]


@pytest.mark.parametrize(("content", "says"), [r[1:] for r in BAD_ROWS], ids=[r[0] for r in BAD_ROWS])
def test_bad_data_row_is_one_line_naming_file_and_line(tmp_path, capsys, content, says):
    """`recipes train` on a JSON-lines file with one bad row: exit 2 before launch, `file:line: why`."""
    from _recipe_helpers import tiny_config

    from automodel.recipes.cli import run_cli

    data = tmp_path / "train.jsonl"
    data.write_bytes(content)
    cfg = tiny_config(
        str(tmp_path / "out"),
        dataset={"source": "json", "path": str(data)},
        validation_dataset=None,
        step_scheduler={"val_every_steps": None},
    )
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert run_cli(["train", str(tmp_path / "cfg.yaml"), "--nproc-per-node=2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {data}") and says in line, line
    assert not (tmp_path / "out").exists()


def test_bad_rows_skip_trains_on_the_good_rows(tmp_path, capfd):
    """``dataset.bad_rows: skip``: one bad row of each kind is skipped and counted (rank 0 prints
    the counts once) and `recipes train` runs to its last step on the good rows."""
    from _recipe_helpers import tiny_config

    from automodel.recipes.cli import run_cli

    data = tmp_path / "train.jsonl"
    good = b"".join(b'{"text": "row %d of some training text"}\n' % i for i in range(40))
    data.write_bytes(good + b"".join(r[1].split(b"\n")[-2] + b"\n" for r in BAD_ROWS[:4]))
    cfg = tiny_config(
        str(tmp_path / "out"),
        dataset={"source": "json", "path": str(data), "bad_rows": "skip"},
        validation_dataset=None,
        step_scheduler={"val_every_steps": None},
    )
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert run_cli(["train", str(tmp_path / "cfg.yaml"), "--nproc-per-node=2"]) == 0
    err = capfd.readouterr().err
    line = (
        "dataset: 40 rows read; skipped 4 of 44 (1 encoding, 1 malformed_json, 1 not_an_object, 1 wrong_type)"
    )
    assert err.count(line) == 1, err
