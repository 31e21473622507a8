"""Faults of the launch itself: launcher flags against the environment, incomplete multi-node flags,
environment leftovers, ports in use, a rendezvous that never completes.

Each case: the exit code, what stderr holds (a refusal: exactly one line ``error: ...``; a rank
that fails in place: that line plus its ``(full traceback: FILE)`` pointer), and nothing lost (the
files already in output_dir unchanged). Refusals made before anything starts run in the CPU suite
(in this process: `run_cli`, no rank or agent is started); the cases that start processes are in
`nox -s faults` (``AUTOMODEL_FAULTS=all``), but for the issue's first case, run once through the
real console path here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _launch_helpers import LAUNCH_PREFIXES, clean_env, free_port, losses, start_train, write_config  # noqa: E402

from automodel.recipes.cli import run_cli  # noqa: E402
from automodel.recipes.launch import agent_env  # noqa: E402
from automodel.recipes.launch_plan import LaunchOptions, plan_launch  # noqa: E402
from automodel.testing.faults import full_only  # noqa: E402

#: The variables of a job step srun started (task 0 of 2) and of an sbatch shell of one task.
SRUN_TASK = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODELIST": "localhost"}  # fmt: skip
SBATCH_SHELL = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODEID": "0",
                "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_NODELIST": "localhost"}  # fmt: skip
#: RANK/WORLD_SIZE/MASTER_* with no sign of torchrun or of a pod (a notebook's leftovers).
TORCHRUN_RANK = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
#: A rank torchrun started (inside a PyTorchJob pod: its PET_* variables inherited).
REAL_TORCHRUN_RANK = {**TORCHRUN_RANK, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1",
                      "TORCHELASTIC_RUN_ID": "job", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2"}  # fmt: skip
#: Pod 1 of a PyTorchJob of 2 pods x 2 ranks, and of a PAI-DLC job.
PYTORCHJOB_POD = {**TORCHRUN_RANK, "RANK": "1", "WORLD_SIZE": "4", "PET_NNODES": "2", "PET_NODE_RANK": "1",
                  "PET_NPROC_PER_NODE": "2", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}  # fmt: skip
PAI_POD = {**TORCHRUN_RANK, "RANK": "1", "NPROC_PER_NODE": "2"}


@pytest.fixture
def job_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A config whose output_dir already holds a run's files; no launcher variable in os.environ."""
    for key in list(os.environ):
        if key.startswith(LAUNCH_PREFIXES):
            monkeypatch.delenv(key)
    out = tmp_path / "run"
    (out / "checkpoints" / "step_2").mkdir(parents=True)
    (out / "checkpoints" / "step_2" / "model.bin").write_bytes(b"weights")
    (out / "checkpoints" / "LATEST").write_text("step_2\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    write_config(tmp_path, out, steps=4)
    return tmp_path


def _files(out: Path) -> dict[str, bytes]:
    """output_dir's files (its logs/ aside: a launcher that started appends there)."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.relative_to(out).parts[0] != "logs"
    }


def _refused(job_dir: Path, capsys: pytest.CaptureFixture, *flags: str) -> str:
    """`recipes train` with `flags` in this process: exit 2, one stderr line, nothing written."""
    out = job_dir / "run"
    before = _files(out)
    t0 = time.monotonic()
    code = run_cli(["train", str(job_dir / "run.yaml"), *flags])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert _files(out) == before
    assert took < 30, took  # refused at once, not after a wait
    return err


@pytest.mark.parametrize(
    ("env", "flags", "names"),
    [
        (
            TORCHRUN_RANK,
            ["--nproc-per-node", "2"],
            ["--nproc-per-node=2", "RANK=0 WORLD_SIZE=2", "unset RANK"],
        ),
        ({**TORCHRUN_RANK, "RANK": "1"}, ["--nproc-per-node", "4"], ["--nproc-per-node=4", "RANK=1"]),
        (TORCHRUN_RANK, ["--nnodes", "2"], ["--nnodes='2'", "WORLD_SIZE=2"]),
        (
            SRUN_TASK,
            ["--nproc-per-node", "2"],
            ["--nproc-per-node=2", "SLURM_PROCID=0", "SLURM_NTASKS=2", "SLURM_STEP_ID=0", "srun --ntasks 1"],
        ),  # fmt: skip
        ({"RANK": "1"}, [], ["RANK='1'", "WORLD_SIZE is not", "unset RANK"]),
        ({"WORLD_SIZE": "4"}, ["--nproc-per-node", "2"], ["WORLD_SIZE='4'", "RANK is not"]),
        (
            REAL_TORCHRUN_RANK,
            ["--nproc-per-node", "2"],
            ["--nproc-per-node=2", "already one rank of a torchrun job", "LOCAL_RANK=1"],
        ),
        # a pod's flags that disagree with its variables: one line naming both
        (PYTORCHJOB_POD, ["--nnodes", "4"], ["--nnodes='4'", "PET_NNODES=2", "WORLD_SIZE counts processes"]),
        (PYTORCHJOB_POD, ["--nproc-per-node", "8"], ["--nproc-per-node=8", "PET_NPROC_PER_NODE=2"]),
        (PAI_POD, ["--node-rank", "0"], ["--node-rank=0", "PAI-DLC pod's RANK=1"]),
        (PAI_POD, ["--rdzv-endpoint", "127.0.0.1:1"], ["--rdzv-endpoint='127.0.0.1:1'", "MASTER_PORT=29511"]),
        ({**PAI_POD, "PET_NODE_RANK": "0"}, [], ["RANK='1'", "disagrees with PET_NODE_RANK='0'"]),
        ({**PYTORCHJOB_POD, "WORLD_SIZE": "3"}, [], ["WORLD_SIZE='3'", "PET_NNODES=2"]),
        ({**PAI_POD, "MASTER_PORT": "x"}, [], ["MASTER_PORT='x'"]),
        ({k: v for k, v in PAI_POD.items() if k != "MASTER_ADDR"}, [], ["MASTER_ADDR=None", "several"]),
    ],
    ids=[
        "torchrun-rank-nproc",
        "torchrun-rank1-nproc4",
        "torchrun-nnodes",
        "srun-task-nproc",
        "rank-alone",
        "world-size-alone",
        "real-torchrun-rank-nproc",
        "pytorchjob-nnodes-world-size",
        "pytorchjob-nproc",
        "pai-node-rank",
        "pai-endpoint",
        "pod-rank-variables",
        "pytorchjob-world-size",
        "pai-bad-port",
        "pai-no-master-addr",
    ],  # fmt: skip
)
def test_launcher_flag_against_the_environment_is_refused(
    job_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, env, flags, names
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    err = _refused(job_dir, capsys, *flags)
    for name in names:
        assert name in err, err


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--nproc-per-node", "1", "--nnodes", "2"], ["--nnodes=2", "needs --node-rank and --rdzv-endpoint"]),
        (["--nnodes", "2", "--node-rank", "1"], ["--nnodes=2", "needs --rdzv-endpoint"]),
        (["--nnodes", "2", "--rdzv-endpoint", "h:29500"], ["--nnodes=2", "needs --node-rank"]),
        (["--node-rank", "1"], ["--node-rank=1", "--nnodes N (N > 1)"]),
        (["--rdzv-endpoint", "h:1"], ["--rdzv-endpoint='h:1'", "--nnodes N (N > 1)"]),
        (["--rdzv-timeout", "5"], ["--rdzv-timeout=5", "--nnodes N (N > 1)"]),
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
            ["--node-rank=2", "< --nnodes (2)"],
        ),
        (["--nnodes", "2", "--node-rank", "-1", "--rdzv-endpoint", "h:1"], ["--node-rank=-1", ">= 0"]),
        (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h"], ["--rdzv-endpoint='h'", "HOST:PORT"]),
        (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", ":29500"], ["--rdzv-endpoint=':29500'"]),
        (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:99999"], ["--rdzv-endpoint='h:99999'"]),
        (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:x"], ["--rdzv-endpoint='h:x'"]),
        (["--nnodes", "1:2"], ["--nnodes='1:2'", "needs --rdzv-endpoint"]),
        (
            ["--nnodes", "2:1", "--rdzv-endpoint", "h:1", "--max-restarts", "1"],
            ["--nnodes='2:1'", "1 <= MIN < MAX"],
        ),
        (["--nnodes", "1:x"], ["--nnodes='1:x'", "MIN:MAX"]),
        (["--nnodes", "x"], ["--nnodes='x'", "an int) or an elastic range MIN:MAX"]),
        (["--nnodes", "1:2", "--rdzv-endpoint", "h:1"], ["--nnodes='1:2'", "needs --max-restarts N >= 1"]),
        (
            ["--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "h:1", "--max-restarts", "1"],
            ["--node-rank=0", "order they join"],
        ),
        (["--nnodes", "0"], ["--nnodes=0", ">= 1"]),
        (["--nproc-per-node", "0"], ["--nproc-per-node=0", ">= 1"]),
        (
            ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:1", "--rdzv-timeout", "0"],
            ["--rdzv-timeout=0", ">= 1"],
        ),  # fmt: skip
    ],
)
def test_incomplete_multi_node_flags_are_refused(
    job_dir: Path, capsys: pytest.CaptureFixture, flags, names
) -> None:
    err = _refused(job_dir, capsys, *flags)
    for name in names:
        assert name in err, err


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_rdzv_port_in_use_on_node_0_is_refused(
    job_dir: Path, capsys: pytest.CaptureFixture, busy_port: int
) -> None:
    endpoint = f"127.0.0.1:{busy_port}"
    err = _refused(job_dir, capsys, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint)
    assert f"--rdzv-endpoint='{endpoint}'" in err and f"port {busy_port} is in use" in err, err


def test_the_environment_decides_who_starts_the_ranks() -> None:
    """(a) a rank of torchrun / srun trains in place; (b) otherwise the CLI is the launcher: an sbatch
    shell (SLURM_PROCID=0 without a step id), WORLD_SIZE=1 or SLURM_NTASKS=1 with --nproc-per-node 2
    start 2 ranks here, never one silently."""
    none: dict[str, object] = {}
    assert plan_launch(none, TORCHRUN_RANK) is None
    assert plan_launch(none, SRUN_TASK) is None
    assert plan_launch(none, {**SRUN_TASK, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}) is None
    two = {"nproc_per_node": 2}
    expected = LaunchOptions(nproc_per_node=2)
    assert plan_launch(two, SBATCH_SHELL) == expected
    assert plan_launch(two, {**SBATCH_SHELL, "SLURM_NTASKS": "8"}) == expected  # the batch shell is no rank
    assert plan_launch(two, {**SRUN_TASK, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}) == expected
    assert plan_launch(two, {**TORCHRUN_RANK, "WORLD_SIZE": "1"}) == expected
    leftovers = {"LOCAL_RANK": "3", "TORCHELASTIC_RUN_ID": "old", "CUDA_VISIBLE_DEVICES": "0"}
    assert plan_launch(two, leftovers) == expected
    assert plan_launch(none, leftovers) == LaunchOptions()


def test_the_agent_environment_follows_torchruns_thread_rule() -> None:
    """Several ranks on a node: one intra-op thread each unless the user chose; a node's only rank
    (a job of one process per node) keeps torch's default, as torchrun leaves it; rank leftovers go."""
    user = {"PATH": "/bin", "RANK": "3", "PET_NNODES": "2", "TORCHELASTIC_RUN_ID": "old"}
    assert agent_env(user, nproc_per_node=2)["OMP_NUM_THREADS"] == "1"
    assert agent_env({**user, "OMP_NUM_THREADS": "4"}, nproc_per_node=2)["OMP_NUM_THREADS"] == "4"
    alone = agent_env(user, nproc_per_node=1)
    assert "OMP_NUM_THREADS" not in alone
    assert not {"RANK", "PET_NNODES", "TORCHELASTIC_RUN_ID"} & alone.keys() and alone["PATH"] == "/bin"


def test_stale_rank_with_nproc_is_refused_by_the_console_script(tmp_path: Path) -> None:
    """The issue's first case through the real console path: exit 2 at once, one line, no rank."""
    out = tmp_path / "run"
    config = write_config(tmp_path, out, steps=4)
    env = clean_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "automodel.recipes.cli", "train", str(config), "--nproc-per-node", "2"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: --nproc-per-node=2: ") and "RANK=0 WORLD_SIZE=2" in proc.stderr
    assert time.monotonic() - t0 < 90
    assert not out.exists()


def _leftover_env(busy_port: int) -> dict[str, str]:
    return clean_env(
        **SBATCH_SHELL,
        LOCAL_RANK="1",
        CUDA_VISIBLE_DEVICES="0",
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RUN_ID="stale",
        TORCHELASTIC_RESTART_COUNT="3",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(busy_port),
    )


@full_only
def test_sbatch_shell_with_leftovers_starts_the_asked_ranks(tmp_path: Path, busy_port: int) -> None:
    """An sbatch shell (SLURM_PROCID=0, SLURM_NTASKS=1) with a stale LOCAL_RANK, TORCHELASTIC_*,
    MASTER_PORT (in use) and CUDA_VISIBLE_DEVICES on a CPU machine: --nproc-per-node 2 trains 2 ranks."""
    out = tmp_path / "run"
    config = write_config(tmp_path, out, steps=2)
    proc = start_train(config, "--nproc-per-node=2", log=tmp_path / "err", env=_leftover_env(busy_port))
    assert proc.wait(timeout=300) == 0, (tmp_path / "err").read_text()[-3000:]
    text = (tmp_path / "err").read_text()
    assert "[rank 1] fsdp2" in text and "trained 2 steps" in text, text[-3000:]
    assert sorted(losses(out)) == [1, 2]


@full_only
def test_leftovers_in_one_process(tmp_path: Path, busy_port: int) -> None:
    """The same leftovers, no launcher flag: one process trains in place (a stale
    TORCHELASTIC_USE_AGENT_STORE must not make it wait for an agent's store nobody runs)."""
    out = tmp_path / "run"
    config = write_config(tmp_path, out, steps=2)
    proc = start_train(config, log=tmp_path / "err", env=_leftover_env(busy_port))
    assert proc.wait(timeout=300) == 0, (tmp_path / "err").read_text()[-3000:]
    assert sorted(losses(out)) == [1, 2]


@full_only
def test_master_port_in_use_is_one_line(job_dir: Path, busy_port: int) -> None:
    """Rank 0 of a torchrun-style job (RANK=0 WORLD_SIZE=1) whose MASTER_PORT is taken: exit 2,
    the error line and its traceback pointer, the output_dir's files as they were."""
    out = job_dir / "run"
    write_config(job_dir, out, steps=4, checkpoint={"enabled": False})  # the fake checkpoint is not read
    before = _files(out)
    env = clean_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(busy_port))
    proc = start_train(job_dir / "run.yaml", log=job_dir / "err", env=env)
    code = proc.wait(timeout=300)
    lines = (job_dir / "err").read_text().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 2, lines[-20:]
    assert len(errors) == 1 and f"127.0.0.1:{busy_port}" in errors[0] and "MASTER_PORT" in errors[0], lines[
        -20:
    ]
    assert lines[lines.index(errors[0]) + 1].startswith("  (full traceback: "), lines[-20:]
    assert {k: v for k, v in _files(out).items() if k != "config.yaml"} == {
        k: v for k, v in before.items() if k != "config.yaml"
    }


@full_only
@pytest.mark.parametrize("alone", [0, 1])
def test_rendezvous_that_never_completes_times_out_with_one_line(job_dir: Path, alone: int) -> None:
    """Only node `alone` of 2 is started: after --rdzv-timeout (5 s) it stops with one line (exit 1)
    naming the endpoint and what to do; no rank started, nothing in output_dir changed."""
    out = job_dir / "run"
    before = _files(out)
    endpoint = f"127.0.0.1:{free_port()}"
    flags = ["--nnodes=2", f"--node-rank={alone}", f"--rdzv-endpoint={endpoint}", "--rdzv-timeout=5"]
    proc = start_train(job_dir / "run.yaml", *flags, log=job_dir / "err")
    code = proc.wait(timeout=300)
    err = (job_dir / "err").read_text()
    assert code == 1, err[-3000:]
    assert len(err.splitlines()) == 1, err[-3000:]
    assert err.startswith(
        f"error: --rdzv-endpoint={endpoint}: the nodes did not meet within --rdzv-timeout=5 s"
    )
    assert f"node {alone} of 2" in err, err
    assert _files(out) == before
