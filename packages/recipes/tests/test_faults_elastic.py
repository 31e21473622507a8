"""Lose a node, keep the job: ``recipes train --nnodes MIN:MAX --max-restarts N`` on loopback.

In the CPU suite (in this process, nothing starts): an elastic range whose smaller worlds cannot
train the config (the global batch against local batch x dp) or whose memory estimate does not fit
is refused before launch with one line. In `nox -s faults` (``AUTOMODEL_FAULTS=all``): two nodes of
one rank each; after a checkpoint the second node's agent is killed (SIGKILL), or the whole node is
stopped (SIGSTOP: hung past the collectives' time-out). The first node restarts, trains on one rank
from the newest complete checkpoint, says so on its rank, and its losses equal a straight one-rank
resume from that checkpoint; every step is in metrics.jsonl and no process of the job is left.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _launch_helpers import LAUNCH_PREFIXES, free_port, losses, start_train, write_config  # noqa: E402

from automodel.recipes.cli import run_cli  # noqa: E402
from automodel.recipes.lifetime import children_of, descendants_of, is_alive  # noqa: E402
from automodel.testing.faults import full_only  # noqa: E402

STEPS = 12
TIMEOUT = 600
RESTART = re.compile(
    r"\[rank 0\] recipes train: restart \d+ of this job: node (\S+) left \(2 -> 1 nodes\); "
    r"resuming from step (\d+) \((\S+)\) on 1 rank \(was 2\)"
)


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(LAUNCH_PREFIXES):
            monkeypatch.delenv(key)


def _refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    code = run_cli(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_a_world_the_job_may_shrink_to_that_cannot_train_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture, clean: None
) -> None:
    """global_batch_size 6, local 2: 3 nodes of 1 rank accumulate once, 2 nodes cannot (6 / (2 x 2)):
    --nnodes 2:3 is refused before launch naming the range, the world and the batch rule."""
    out = tmp_path / "run"
    config = write_config(tmp_path, out, steps=4)
    endpoint = f"127.0.0.1:{free_port()}"
    flags = ["--nnodes", "2:3", "--rdzv-endpoint", endpoint, "--max-restarts", "1",
             "--step_scheduler.global_batch_size=6", "--step_scheduler.local_batch_size=2"]  # fmt: skip
    err = _refused(["train", str(config), *flags], capsys)
    assert "--nnodes='2:3': on 2 node(s) (2 ranks) the run cannot train" in err, err
    assert "global_batch_size=6" in err, err
    assert not out.exists()


def test_a_world_whose_memory_estimate_does_not_fit_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, clean: None
) -> None:
    """The per-rank memory estimate of each world is checked against what one rank has here (a
    machine whose ranks have less than the 1-rank estimate and more than the 2-rank one: the 1-rank
    world, whose rank holds all the parameters and optimizer state, is refused)."""
    import torch

    import automodel.recipes.elastic as elastic
    from automodel.recipes import load_config
    from automodel.recipes.plan import estimate_memory
    from automodel.recipes.resolved_run import resolve_run

    out = tmp_path / "run"
    config = write_config(tmp_path, out, steps=4)
    peaks = {}
    for world in (1, 2):
        run = resolve_run(load_config(str(config)), world_size=world, this_machine=True)
        peaks[world] = estimate_memory(
            run.cfg, run.layout, run.hf_config, on_gpu=torch.cuda.is_available()
        ).peak_bytes
    assert peaks[1] > peaks[2], peaks
    limit = (peaks[1] + peaks[2]) / 2
    monkeypatch.setattr(elastic, "rank_memory_bytes", lambda *, ranks_per_node: (limit, "a test's limit"))
    endpoint = f"127.0.0.1:{free_port()}"
    flags = ["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--max-restarts", "1"]
    err = _refused(["train", str(config), *flags], capsys)
    assert (
        "--nnodes='1:2': on 1 node(s) (1 rank) the per-rank memory estimate is" in err
        and "a test's limit" in err
    ), err
    assert not out.exists()


def _wait_listening(port: int, proc: subprocess.Popen, log: Path) -> None:
    """Until node 0's agent hosts the rendezvous (so node 0, which survives, holds the job's store)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "node 0 never hosted the rendezvous"
        time.sleep(0.2)


def _job_processes(config: Path) -> list[int]:
    """Every live process whose command line names `config` (launchers, agents, ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(config).encode() in cmdline and is_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _lose_node(tmp_path: Path, *, hang: bool) -> None:
    """Two elastic nodes, one rank each; node 1 killed (its agent) or stopped (all of it) after a
    checkpoint; node 0 must finish on one rank exactly as a one-rank resume of the same checkpoint."""
    out = tmp_path / "run"
    sections = {"dist_env": {"timeout_minutes": 0.3}} if hang else {}
    config = write_config(tmp_path, out, steps=STEPS, **sections)
    port = free_port()
    flags = ["--nnodes=1:2", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=1", "--rdzv-timeout=120"]
    logs = [tmp_path / "node0.stderr", tmp_path / "node1.stderr"]
    procs = [start_train(config, *flags, log=logs[0])]
    try:
        _wait_listening(port, procs[0], logs[0])
        procs.append(start_train(config, *flags, log=logs[1]))
        deadline = time.monotonic() + TIMEOUT
        latest = out / "checkpoints" / "LATEST"
        # node 1 runs a rank of the 2-rank world (it may join after node 0 started alone), and a
        # checkpoint of that world is complete
        while "[rank 1] fsdp2" not in logs[1].read_text():
            assert all(p.poll() is None for p in procs), [log.read_text()[-2000:] for log in logs]
            assert time.monotonic() < deadline, "node 1 never trained"
            time.sleep(0.2)
        before = latest.read_text() if latest.is_file() else None
        while not latest.is_file() or latest.read_text() == before:
            assert all(p.poll() is None for p in procs), [log.read_text()[-2000:] for log in logs]
            assert time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.2)
        seen = set(descendants_of(procs[0].pid) + descendants_of(procs[1].pid))
        if hang:
            stopped = [procs[1].pid, *descendants_of(procs[1].pid)]
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
        else:
            os.kill(children_of(procs[1].pid)[0], signal.SIGKILL)  # node 1's torchrun agent
        while procs[0].poll() is None:
            seen.update(descendants_of(procs[0].pid))  # the restarted rank too
            assert time.monotonic() < deadline + TIMEOUT, "node 0 did not finish"
            time.sleep(0.5)
        code0 = procs[0].wait()
        if hang:
            for pid in stopped:
                os.kill(pid, signal.SIGKILL) if is_alive(pid) else None
        code1 = procs[1].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = logs[0].read_text()
    assert code0 == 0, text[-4000:]
    assert code1 != 0
    restart = RESTART.search(text)
    assert restart is not None, text[-4000:]
    step = int(restart.group(2))
    assert f"resumed from step {step} (" in text
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)), got  # nothing lost
    # a straight one-rank resume from the same checkpoint
    ref_out = tmp_path / "reference"
    ref_config = write_config(
        tmp_path, ref_out, steps=STEPS, checkpoint={"restore_from": restart.group(3)}, **sections
    )
    ref = start_train(ref_config, log=tmp_path / "reference.stderr")
    assert ref.wait(timeout=TIMEOUT) == 0, (tmp_path / "reference.stderr").read_text()[-3000:]
    want = losses(ref_out)
    assert sorted(want) == list(range(step + 1, STEPS + 1)), want
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-6, f"step {s}: {got[s]} vs one-rank resume {want[s]}"
    assert not [pid for pid in seen if is_alive(pid)], "a process of the job outlived it"
    assert not _job_processes(config), _job_processes(config)


@full_only
def test_killed_node_the_other_continues_on_one_rank(tmp_path: Path) -> None:
    _lose_node(tmp_path, hang=False)


@full_only
def test_hung_node_the_other_continues_on_one_rank(tmp_path: Path) -> None:
    _lose_node(tmp_path, hang=True)


@full_only
def test_a_node_that_comes_back_joins_at_the_next_restart(tmp_path: Path) -> None:
    """Node 1's agent killed after a 2-rank checkpoint; node 0 restarts alone; node 1 started again
    with the same command joins: node 0's ranks restart to admit it and the job ends on 2 ranks.
    The 1-rank phase equals a straight 1-rank resume of its checkpoint, the 2-rank phase a straight
    2-rank resume of the checkpoint it restarted from (1e-6).
    300 steps (2 epochs of the tiny data, a checkpoint every 10) keep node 0 training while node 1
    starts again."""
    steps = 300
    out = tmp_path / "run"
    config = write_config(tmp_path, out, steps=steps)
    port = free_port()
    flags = ["--nnodes=1:2", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=1", "--rdzv-timeout=300",
             "--step_scheduler.ckpt_every_steps=10", "--step_scheduler.num_epochs=2"]  # fmt: skip
    logs = [tmp_path / "node0.stderr", tmp_path / "node1.stderr", tmp_path / "node1_again.stderr"]
    latest = out / "checkpoints" / "LATEST"
    procs = [start_train(config, *flags, log=logs[0])]
    try:
        _wait_listening(port, procs[0], logs[0])
        procs.append(start_train(config, *flags, log=logs[1]))
        deadline = time.monotonic() + TIMEOUT
        while "[rank 1] fsdp2" not in logs[1].read_text():
            assert all(p.poll() is None for p in procs), [log.read_text()[-2000:] for log in logs[:2]]
            assert time.monotonic() < deadline, "node 1 never trained"
            time.sleep(0.2)
        before = latest.read_text() if latest.is_file() else None
        while not latest.is_file() or latest.read_text() == before:  # a checkpoint of the 2-rank world
            assert all(p.poll() is None for p in procs), [log.read_text()[-2000:] for log in logs[:2]]
            assert time.monotonic() < deadline, "no 2-rank checkpoint"
            time.sleep(0.2)
        os.kill(children_of(procs[1].pid)[0], signal.SIGKILL)
        procs[1].wait(timeout=60)
        while RESTART.search(logs[0].read_text()) is None:
            assert procs[0].poll() is None, logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "node 0 never restarted"
            time.sleep(0.2)
        procs.append(start_train(config, *flags, log=logs[2]))  # node 1 comes back
        codes = [procs[0].wait(timeout=TIMEOUT), procs[2].wait(timeout=TIMEOUT)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    # every rank says it (the rendezvous may give either node rank 0)
    joined = re.compile(
        r"\[rank [01]\] recipes train: restart \d+ of this job: node (\S+) joined \(1 -> 2 nodes\); "
        r"resuming from step (\d+) \((\S+)\) on 2 ranks \(was 1\)"
    )
    # the last restarts: node 1 left, then came back (node 0 may have started alone, node 1 joining it)
    lefts, joins = list(RESTART.finditer(texts[0])), list(joined.finditer(texts[0]))
    assert lefts and joins and joined.search(texts[2]), texts[2][-3000:]
    left, join = lefts[-1], joins[-1]
    assert left.end() < join.start(), texts[0][-3000:]
    got = losses(out)
    assert sorted(got) == list(range(1, steps + 1)), got  # nothing lost
    # each phase equals a straight resume of its checkpoint on its world: 1 rank, then 2 ranks
    for ranks, resumed, until in ((1, left, int(join.group(2))), (2, join, steps)):  # (node, step, path)
        ref_out = tmp_path / f"reference_{ranks}"
        ref_config = write_config(
            tmp_path, ref_out, steps=steps, checkpoint={"restore_from": resumed.group(3)}
        )
        ref = start_train(
            ref_config,
            f"--nproc-per-node={ranks}",
            "--step_scheduler.num_epochs=2",
            log=tmp_path / f"ref{ranks}.stderr",
        )
        assert ref.wait(timeout=TIMEOUT) == 0, (tmp_path / f"ref{ranks}.stderr").read_text()[-3000:]
        want = losses(ref_out)
        for s in range(int(resumed.group(2)) + 1, until + 1):
            assert abs(got[s] - want[s]) <= 1e-6, f"step {s}: {got[s]} vs a {ranks}-rank resume {want[s]}"
    assert not _job_processes(config), _job_processes(config)
