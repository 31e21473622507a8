"""Start the ranks of `recipes train` through torch's own launcher (torch.distributed.run).

When more than one process is asked for and this process was not itself started by torchrun or
SLURM `srun`, the CLI re-runs itself under ``python -m torch.distributed.run``; otherwise it runs
the training in place.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from automodel.mesh import detect_launch_env


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


def torchrun_command(opts: LaunchOptions, train_args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={opts.nproc_per_node}"]
    cmd.append(f"--nnodes={opts.nnodes}")
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


def launch_torchrun(opts: LaunchOptions, train_args: list[str]) -> int:
    """Run the ranks under torchrun and return its exit code (0 when every rank succeeded)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(torchrun_command(opts, train_args), env=env)
