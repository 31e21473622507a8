"""Start the ranks of `recipes train` through torch's own launcher (torch.distributed.run).

When more than one process is asked for (`automodel.recipes.launch_plan` decides who starts the
ranks), the CLI re-runs itself under torchrun's agent (`automodel.recipes._agent`, torch's
own launcher run in a session of its own); otherwise it runs the training in place.

The launcher owns the job: the agent and every rank die with it (parent-death signals, see
`automodel.recipes.lifetime`); SIGTERM, SIGINT or SIGHUP to the launcher is passed to the ranks as
SIGTERM (pre-emption: they save a checkpoint and stop) and the launcher exits only once they have
finished; a second signal kills the job. Failed ranks report through `automodel.recipes.rank_errors`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel.recipes import rank_errors
from automodel.recipes._agent import AGENT_RANKS_CPP_LOG_LEVEL, read_agent_error
from automodel.recipes.elastic import JOB_STORE_VARIABLE, run_file
from automodel.recipes.launch_plan import LaunchOptions
from automodel.recipes.lifetime import children_of

if TYPE_CHECKING:
    from automodel.recipes.resolved_run import ResolvedRun


#: What torchrun sets for each rank (and a job script or notebook may have left behind): never passed
#: to the agent, which sets them afresh for the ranks it starts.
RANK_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def agent_env(environ: dict[str, str], *, nproc_per_node: int) -> dict[str, str]:
    """The agent's environment: `environ` without rank variables, TORCHELASTIC_* leftovers and a
    pod's PET_* variables (torchrun's defaults for the flags this launcher passes itself).

    Several ranks on a node get one intra-op thread each unless the user set OMP_NUM_THREADS
    (torchrun's own default, without its banner); a node's only rank keeps torch's default of
    every core, as under torchrun, so one process is not held to one core."""
    env = {
        k: v
        for k, v in environ.items()
        if k not in RANK_VARIABLES and not k.startswith(("TORCHELASTIC_", "PET_"))
    }
    env.pop(JOB_STORE_VARIABLE, None)  # set below for a job of several nodes only
    if nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    # the agent's own C++ log lines (a rendezvous client timing out, with a stack) stay off the
    # terminal; the agent gives the ranks the user's level back (AGENT_RANKS_CPP_LOG_LEVEL)
    env[AGENT_RANKS_CPP_LOG_LEVEL] = env.get("TORCH_CPP_LOG_LEVEL", "")
    env["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    return env


def torchrun_args(opts: LaunchOptions, train_args: list[str]) -> list[str]:
    """torchrun's arguments (after ``python -m torch.distributed.run``) for `recipes train` ranks.

    Several nodes meet in torch's static rendezvous: node `node_rank` gets ranks
    ``node_rank * nproc_per_node ...``, node 0 hosts the store at the endpoint, and every node
    waits at most `rdzv_timeout` seconds for the others. An elastic job (``--nnodes MIN:MAX``) meets
    in torch's c10d rendezvous (the store on the endpoint's host; ranks in the order nodes join)."""
    cmd = [f"--nproc-per-node={opts.nproc_per_node}"]
    if opts.min_nnodes is not None:  # elastic: c10d rendezvous, the store on the endpoint's host
        cmd += [
            f"--nnodes={opts.min_nnodes}:{opts.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={opts.rdzv_endpoint}",
            f"--rdzv-conf=join_timeout={opts.rdzv_timeout}",
            f"--rdzv-id={opts.rdzv_id if opts.rdzv_id is not None else 'automodel'}",
        ]
    elif opts.nnodes == 1:
        cmd += [f"--nnodes={opts.nnodes}", "--standalone"]
    else:
        cmd += [
            f"--nnodes={opts.nnodes}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={opts.rdzv_endpoint}",
            f"--node-rank={opts.node_rank}",
            f"--rdzv-conf=timeout={opts.rdzv_timeout}",
        ]
        if opts.rdzv_id is not None:
            cmd.append(f"--rdzv-id={opts.rdzv_id}")
    cmd.append(f"--max-restarts={opts.max_restarts}")
    cmd += ["-m", "automodel.recipes.cli", "train", *train_args]
    return cmd


def torchrun_command(opts: LaunchOptions, train_args: list[str]) -> list[str]:
    """The plain torchrun command line of the same job (what a user would type by hand)."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(opts, train_args)]


def rendezvous_line(opts: LaunchOptions, reason: str) -> str:
    """The one line of a rendezvous that failed (the other nodes never joined, or node 0 is not up)."""
    where = (
        f"a node of --nnodes {opts.min_nnodes}:{opts.nnodes}"
        if opts.min_nnodes is not None
        else f"node {opts.node_rank} of {opts.nnodes}"
    )
    return (
        f"--rdzv-endpoint={opts.rdzv_endpoint}: the nodes did not meet within --rdzv-timeout={opts.rdzv_timeout} s "
        f"({where}: {reason}); start `recipes train` with the same --nnodes and --rdzv-endpoint and "
        f"--node-rank 0..{opts.nnodes - 1} on every node (node 0 at that address), or raise --rdzv-timeout"
    )


class _Forwarder:
    """The launcher's SIGTERM/SIGINT/SIGHUP handler: first signal -> SIGTERM to the ranks, second -> kill."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, agent: subprocess.Popen, *, saves: bool) -> None:
        self.agent = agent
        self.saves = saves  # checkpointing is on: the ranks save before they stop
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Forwarder:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            print(f"recipes: {name} again: killing the job", file=sys.stderr, flush=True)
            self.agent.kill()  # the ranks die with it (parent-death signal)
            return
        self.received = signum
        ranks = children_of(self.agent.pid)
        what = (
            "save a checkpoint and stop"
            if self.saves
            else "stop (checkpointing is disabled: nothing is saved)"
        )
        print(
            f"recipes: {name} received: asking the {len(ranks)} rank(s) to {what}; "
            "waiting for them (send it again to kill the job)",
            file=sys.stderr,
            flush=True,
        )
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if not ranks:  # still starting: torchrun's agent stops what it has started
            self.agent.send_signal(signal.SIGTERM)


def launch_torchrun(
    opts: LaunchOptions,
    train_args: list[str],
    *,
    runs: Mapping[int, ResolvedRun],
    saves_on_sigterm: bool = True,
) -> int:
    """Run the ranks under torchrun's agent; return 0 when every rank succeeded.

    `runs` (resolved once on this machine, by world size: one, or one per node count of an
    elastic job) are pickled into a private directory the ranks are named (``--launcher-resolved``):
    each rank trains the one of its world size without resolving the config again.

    On failure, print one line per distinct error the ranks reported (exit 2 for user mistakes),
    or the root-cause rank's traceback, or the tail of torchrun's log when no rank reported.
    """
    env = agent_env(dict(os.environ), nproc_per_node=opts.nproc_per_node)
    if opts.nnodes > 1 and opts.rdzv_endpoint is not None:  # the ranks' restart line reads it
        env[JOB_STORE_VARIABLE] = opts.rdzv_endpoint
    if opts.elastic:
        # each restart's rank 0 hosts a fresh store for its ranks: the agents' restart counts differ
        # once a node joins with a new agent (pytorch/pytorch#135712), so no store may outlive a world
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    error_dir = tempfile.mkdtemp(prefix="automodel-rank-errors-")
    run_dir = Path(tempfile.mkdtemp(prefix="automodel-run-"))
    log = Path(next(iter(runs.values())).output_dir) / "logs" / "torchrun.log"
    try:
        for world, run in runs.items():
            run.save(run_file(run_dir, world))
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "automodel.recipes._agent", f"--parent={os.getpid()}", f"--log={log}",
            f"--error-dir={error_dir}", "--",
            *torchrun_args(
                opts,
                [*train_args, f"--launcher-error-dir={error_dir}", f"--launcher-resolved={run_dir}"],
            ),
        ]  # fmt: skip
        agent = subprocess.Popen(cmd, env=env, start_new_session=True)
        with _Forwarder(agent, saves=saves_on_sigterm) as forwarder:
            code = agent.wait()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # the ranks have stopped (or never started)
    try:
        reports = rank_errors.read_reports(error_dir) if code != 0 else []
        if forwarder.received is not None and not any(r.line for r in reports):
            name = signal.Signals(forwarder.received).name
            print(f"recipes: the ranks stopped after {name}", file=sys.stderr, flush=True)
            return 128 + forwarder.received
        if code == 0:
            return 0
        if reports:
            code, lines = rank_errors.summarize(reports)
        elif (rdzv := read_agent_error(error_dir)) is not None:
            code, lines = rank_errors.EXIT_RUN_ERROR, [f"error: {rendezvous_line(opts, rdzv)}"]
        else:
            tail = log.read_text(errors="replace").splitlines()[-25:] if log.is_file() else []
            lines = [*tail, f"recipes train: torchrun exited with {code}; its log: {log}"]
        rank_errors.print_lines(lines)
        return code
    finally:
        if not any(p.suffix == ".log" for p in Path(error_dir).iterdir()):
            shutil.rmtree(error_dir, ignore_errors=True)
