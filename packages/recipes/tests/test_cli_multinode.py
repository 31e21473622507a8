"""Several nodes on loopback: `recipes train` as its own launcher on each "node", and as srun's tasks.

In the CPU suite: two launchers (``--nnodes 2 --node-rank 0/1 --rdzv-endpoint 127.0.0.1:PORT``, one
rank each) and two srun-style tasks (SLURM's variables, MASTER_ADDR from the node list) train the
tiny config with the same losses as one node with the same world size (1e-6), and the 2-node
checkpoint resumes in one process. `nox -s faults` (``AUTOMODEL_FAULTS=all``) adds two ranks per
node, a one-node checkpoint resumed on two nodes, and a killed node.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _launch_helpers import clean_env, finish, free_port, losses, start_train, write_config  # noqa: E402
from _recipe_helpers import RTOL, preload, tiny_config  # noqa: E402

from automodel.recipes.lifetime import descendants_of, is_alive  # noqa: E402
from automodel.testing.faults import full_only  # noqa: E402
from automodel.testing.ranks import run_on_ranks  # noqa: E402

STEPS = 4
TIMEOUT = 300


def _reference_on_rank(raw: dict) -> list[float]:
    from automodel.recipes import load_config
    from automodel.recipes.trainer import run_training

    return run_training(load_config(raw)).losses


def _reference(tmp: Path, world_size: int) -> list[float]:
    """The losses of one node with `world_size` ranks (the same config, forked gloo ranks)."""
    preload()
    raw = tiny_config(
        str(tmp / f"reference_{world_size}"),
        step_scheduler={"max_steps": STEPS, "val_every_steps": None},
        validation_dataset=None,
    )
    return run_on_ranks(_reference_on_rank, world_size=world_size, args=(raw,), timeout_s=TIMEOUT)[0]


@pytest.fixture(scope="module")
def reference_2(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _reference(tmp_path_factory.mktemp("reference"), 2)


def _assert_equal(got: dict[int, float], ref: list[float], *, tol: float = 1e-6, first: int = 1) -> None:
    assert sorted(got) == list(range(first, STEPS + 1)), got
    for step in range(first, STEPS + 1):
        assert abs(got[step] - ref[step - 1]) <= tol, f"step {step}: {got[step]} vs one node {ref[step - 1]}"


def _nodes(config: Path, tmp: Path, *, nproc: int, extra: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    port = free_port()
    return [
        start_train(
            config,
            "--nnodes=2",
            f"--node-rank={node}",
            f"--nproc-per-node={nproc}",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-timeout=120",
            *extra,
            log=tmp / f"node{node}.stderr",
        )  # fmt: skip
        for node in range(2)
    ]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two `recipes train` launchers on loopback, one rank each, sharing one output_dir."""
    tmp = tmp_path_factory.mktemp("two_nodes")
    out = tmp / "run"
    procs = _nodes(write_config(tmp, out, steps=STEPS), tmp, nproc=1)
    finish(procs, [tmp / "node0.stderr", tmp / "node1.stderr"])
    return out


def test_two_nodes_one_rank_each_equal_one_node(two_nodes: Path, reference_2: list[float]) -> None:
    _assert_equal(losses(two_nodes), reference_2)
    assert (two_nodes / "checkpoints" / "step_2").is_dir()


def test_two_node_checkpoint_resumes_in_one_process(
    two_nodes: Path, reference_2: list[float], tmp_path: Path
) -> None:
    """The 2-node run's step-2 checkpoint, resumed by one process: steps 3-4 as the 2-rank run's
    (to RTOL, the project's one-process parity: one rank accumulates what two ranks sum)."""
    out = tmp_path / "resumed"
    restore = str(two_nodes / "checkpoints" / "step_2")
    config = write_config(tmp_path, out, steps=STEPS, checkpoint={"restore_from": restore})
    proc = start_train(config, log=tmp_path / "resume.stderr")
    finish([proc], [tmp_path / "resume.stderr"])
    got = losses(out)
    assert sorted(got) == [3, 4], got
    for step in (3, 4):
        ref = reference_2[step - 1]
        assert abs(got[step] - ref) <= RTOL * abs(ref), f"step {step}: {got[step]} vs {ref}"


def _srun_env(task: int, *, tasks: int, job_id: int) -> dict[str, str]:
    """The variables srun sets for task `task` of `tasks`, one task per node on nodes 127.0.0.[1-N]."""
    nodelist = f"127.0.0.[1-{tasks}]"
    return clean_env(
        SLURM_JOB_ID=str(job_id), SLURM_JOBID=str(job_id), SLURM_STEP_ID="0", SLURM_STEPID="0",
        SLURM_PROCID=str(task), SLURM_NTASKS=str(tasks), SLURM_STEP_NUM_TASKS=str(tasks),
        SLURM_NODEID=str(task), SLURM_LOCALID="0", SLURM_NNODES=str(tasks), SLURM_STEP_NUM_NODES=str(tasks),
        SLURM_NODELIST=nodelist, SLURM_JOB_NODELIST=nodelist, SLURM_STEP_NODELIST=nodelist,
        SLURM_TASKS_PER_NODE=f"1(x{tasks})", SLURM_STEP_TASKS_PER_NODE=f"1(x{tasks})",
    )  # fmt: skip


def test_srun_tasks_equal_one_node(tmp_path: Path, reference_2: list[float]) -> None:
    """Two tasks with srun's variables (no MASTER_ADDR / MASTER_PORT: rank 0's host is the node list's
    first, the port 20000 + SLURM_JOB_ID % 20000): each is one rank; losses as one node's 2 ranks."""
    out = tmp_path / "run"
    config = write_config(tmp_path, out, steps=STEPS)
    job_id = free_port(20000, 40000) - 20000
    logs = [tmp_path / f"task{t}.stderr" for t in range(2)]
    procs = [start_train(config, log=logs[t], env=_srun_env(t, tasks=2, job_id=job_id)) for t in range(2)]
    finish(procs, logs)
    _assert_equal(losses(out), reference_2)


@full_only
def test_two_nodes_two_ranks_each_equal_one_node(tmp_path: Path) -> None:
    out = tmp_path / "run"
    procs = _nodes(write_config(tmp_path, out, steps=STEPS), tmp_path, nproc=2)
    finish(procs, [tmp_path / "node0.stderr", tmp_path / "node1.stderr"])
    _assert_equal(losses(out), _reference(tmp_path, 4))


@full_only
def test_one_node_checkpoint_resumes_on_two_nodes(tmp_path: Path, reference_2: list[float]) -> None:
    """Steps 1-2 on one node (2 ranks, the CLI's launcher), steps 3-4 on two nodes (one rank each)."""
    out = tmp_path / "run"
    config = write_config(tmp_path, out, steps=STEPS)
    first = start_train(
        config, "--nproc-per-node=2", "--step_scheduler.max_steps=2", log=tmp_path / "first.stderr"
    )
    finish([first], [tmp_path / "first.stderr"])
    procs = _nodes(config, tmp_path, nproc=1)
    finish(procs, [tmp_path / "node0.stderr", tmp_path / "node1.stderr"])
    assert (
        "resumed from step 2 ("
        in (tmp_path / "node0.stderr").read_text() + (tmp_path / "node1.stderr").read_text()
    )
    _assert_equal(losses(out), reference_2)


@full_only
@pytest.mark.parametrize("killed", [1, 0])
def test_killed_node_ends_the_other_and_is_named(tmp_path: Path, killed: int) -> None:
    """SIGKILL of one node's launcher: the other node's ranks end within 60 s, and its launcher's
    error names the node that failed."""
    out = tmp_path / "run"
    config = write_config(tmp_path, out, steps=400)
    procs = _nodes(config, tmp_path, nproc=1)
    survivor = procs[1 - killed]
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(losses(out)) < 3:
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            assert time.monotonic() < deadline, "no step 3"
            time.sleep(0.2)
        tree = descendants_of(survivor.pid)
        procs[killed].send_signal(signal.SIGKILL)
        procs[killed].wait()
        t0 = time.monotonic()
        code = survivor.wait(timeout=90)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert took < 60, took
    assert not [pid for pid in tree if is_alive(pid)]
    text = (tmp_path / f"node{1 - killed}.stderr").read_text()
    assert code == 1, text[-3000:]
    assert f"node {killed} " in text and "stopped" in text, text[-3000:]
