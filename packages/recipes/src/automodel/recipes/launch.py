"""Start the ranks of `recipes train` through torch's own launcher (torch.distributed.run).

When more than one process is asked for and this process was not itself started by torchrun or
SLURM `srun`, the CLI re-runs itself under torchrun's agent (`automodel.recipes._agent`, torch's
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel.mesh import detect_launch_env
from automodel.recipes import rank_errors
from automodel.recipes.lifetime import children_of

if TYPE_CHECKING:
    from automodel.recipes.resolved_run import ResolvedRun


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int = 1
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0

    @property
    def multi_process(self) -> bool:
        return self.nproc_per_node > 1 or self.nnodes not in ("1", "1:1")


def already_launched() -> bool:
    """True under torchrun (RANK/WORLD_SIZE set) or SLURM srun (SLURM_PROCID set)."""
    return detect_launch_env().launcher != "single"


def torchrun_args(opts: LaunchOptions, train_args: list[str]) -> list[str]:
    """torchrun's arguments (after ``python -m torch.distributed.run``) for `recipes train` ranks."""
    cmd = [f"--nproc-per-node={opts.nproc_per_node}", f"--nnodes={opts.nnodes}"]
    if opts.rdzv_endpoint is None and opts.nnodes in ("1", "1:1"):
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={opts.rdzv_endpoint}"]
        if opts.rdzv_id is not None:
            cmd.append(f"--rdzv-id={opts.rdzv_id}")
    if opts.node_rank is not None:
        cmd.append(f"--node-rank={opts.node_rank}")
    cmd.append(f"--max-restarts={opts.max_restarts}")
    cmd += ["-m", "automodel.recipes.cli", "train", *train_args]
    return cmd


def torchrun_command(opts: LaunchOptions, train_args: list[str]) -> list[str]:
    """The plain torchrun command line of the same job (what a user would type by hand)."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(opts, train_args)]


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
    opts: LaunchOptions, train_args: list[str], *, run: ResolvedRun, saves_on_sigterm: bool = True
) -> int:
    """Run the ranks under torchrun's agent; return 0 when every rank succeeded.

    `run` (resolved once on this machine) is pickled into a private directory the ranks are named
    (``--launcher-resolved``): they train it without resolving the config again.

    On failure, print one line per distinct error the ranks reported (exit 2 for user mistakes),
    or the root-cause rank's traceback, or the tail of torchrun's log when no rank reported.
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    error_dir = tempfile.mkdtemp(prefix="automodel-rank-errors-")
    run_dir = Path(tempfile.mkdtemp(prefix="automodel-run-"))
    log = Path(run.output_dir) / "logs" / "torchrun.log"
    try:
        run.save(run_dir / "run.pkl")
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "automodel.recipes._agent", f"--parent={os.getpid()}", f"--log={log}", "--",
            *torchrun_args(
                opts,
                [*train_args, f"--launcher-error-dir={error_dir}", f"--launcher-resolved={run_dir / 'run.pkl'}"],
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
        else:
            tail = log.read_text(errors="replace").splitlines()[-25:] if log.is_file() else []
            lines = [*tail, f"recipes train: torchrun exited with {code}; its log: {log}"]
        rank_errors.print_lines(lines)
        return code
    finally:
        if not any(p.suffix == ".log" for p in Path(error_dir).iterdir()):
            shutil.rmtree(error_dir, ignore_errors=True)
