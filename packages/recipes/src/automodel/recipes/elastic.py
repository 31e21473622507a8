"""An elastic job (``--nnodes MIN:MAX``): every world it may shrink or grow to, checked before launch,
and the line each rank prints when the job restarts.

torchrun's elastic agent (c10d rendezvous) restarts the ranks of the surviving nodes when a node
dies or hangs past the collectives' time-out (``dist_env.timeout_minutes``), and again when a node
joins; each restart resumes from the newest complete checkpoint, on however many ranks the
rendezvous gathered. The `recipes` launcher resolves the run for every node count in MIN..MAX before
anything starts (`resolve_worlds`: the layout, the global batch against local batch x dp, which keeps
``global_batch_size`` and changes the gradient accumulation, and the per-rank memory estimate against
this machine's memory); the ranks of each restart train the run resolved for their world size.

At every (re)start the ranks name their nodes, and rank 0 keeps them in the store of torchrun's
agent, which lives for the whole job; after a restart every rank prints which nodes left or joined,
the step it resumes from and its world now (`announce_start`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from automodel.recipes.errors import ConfigError

if TYPE_CHECKING:
    from automodel.recipes.resolved_run import ResolvedRun

_PREFIX = "automodel/members"
_WAIT = timedelta(seconds=60)


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def rank_memory_bytes(*, ranks_per_node: int) -> tuple[float, str]:
    """The memory one rank may use here: its GPU's, else this machine's RAM shared by its ranks."""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return float(total), f"GPU memory {_gib(total)}"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / ranks_per_node, f"RAM {_gib(ram)} / {ranks_per_node} ranks"


def memory_estimate(run: ResolvedRun) -> tuple[float, str]:
    """(the per-rank peak bytes of one step of `run`, its phase), as `recipes validate` prints it."""
    # lazy: start-up, automodel.recipes.plan ~4 s (the launcher needs it only for an elastic job)
    from automodel.recipes.plan import estimate_memory

    mem = estimate_memory(
        run.cfg, run.layout, run.hf_config, stages=run.stages, on_gpu=torch.cuda.is_available()
    )
    return mem.peak_bytes, mem.peak_phase


def resolve_worlds(
    resolve: Callable[[int], ResolvedRun], *, min_nodes: int, max_nodes: int, ranks_per_node: int, key: str
) -> dict[int, ResolvedRun]:
    """The run resolved for every world of MIN..MAX nodes (`resolve(world_size)`), each one's
    memory estimate checked against what a rank has here; the first world that cannot train is
    refused, naming the range, the world and why."""
    runs = {}
    limit, what = rank_memory_bytes(ranks_per_node=ranks_per_node)
    for nodes in range(max_nodes, min_nodes - 1, -1):
        world = nodes * ranks_per_node
        where = f"on {nodes} node(s) ({world} rank{'s' if world != 1 else ''})"
        try:
            run = resolve(world)
        except ConfigError as e:
            raise ConfigError(key, f"{min_nodes}:{max_nodes}", f"{where} the run cannot train: {e}") from None
        peak, phase = memory_estimate(run)
        if peak > limit:
            raise ConfigError(
                key,
                f"{min_nodes}:{max_nodes}",
                f"{where} the per-rank memory estimate is {_gib(peak)} (peak at {phase}), more than "
                f"{what}: the job cannot shrink that far; raise MIN",
            )
        runs[world] = run
    return runs


def run_file(run_dir: Path, world_size: int) -> Path:
    """Where the launcher leaves the run resolved for `world_size` ranks."""
    return run_dir / f"run_{world_size}.pkl"


def node_name() -> str:
    """This rank's node as the lines name it: its host and its torchrun agent's pid (the agent
    lives across restarts; a node that comes back has a new one)."""
    return f"{socket.gethostname()}/{os.getppid()}"


def _latest_step(output_dir: str) -> str:
    latest = Path(output_dir) / "checkpoints" / "LATEST"
    try:
        name = latest.read_text().strip()
    except OSError:
        return "the start (no complete checkpoint yet)"
    return f"step {name.removeprefix('step_')} ({latest.parent / name})"


#: HOST:PORT of the store that lives as long as the job (the rendezvous endpoint of a job of several
#: nodes), set by the `recipes` launcher for its ranks; else the agent's store (MASTER_ADDR / MASTER_PORT).
JOB_STORE_VARIABLE = "AUTOMODEL_JOB_STORE"


def _job_store(env: Mapping[str, str]) -> dist.Store | None:
    """The store that outlives every restart of the job, or None.

    On one node torchrun's agent hosts the ranks' store (MASTER_ADDR / MASTER_PORT) for the whole
    job; on several, that store belongs to the rendezvous' rank 0 and is replaced when rank 0 is
    lost, while the rendezvous endpoint's store lives as long as the job."""
    if JOB_STORE_VARIABLE in env:
        host, _, port = env[JOB_STORE_VARIABLE].rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
    elif env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in env:
        host, port = env["MASTER_ADDR"], env["MASTER_PORT"]
    else:
        return None
    store = dist.TCPStore(host, int(port), is_master=False, timeout=_WAIT, wait_for_workers=False)
    return dist.PrefixStore(f"{_PREFIX}/{env.get('TORCHELASTIC_RUN_ID', '')}", store)


def announce_start(*, output_dir: str, env: Mapping[str, str] | None = None) -> str | None:
    """Every rank of a job torchrun's agent started, once its process group is up: after a restart
    (this job's store has counted an earlier start), the line saying which nodes left or joined, the
    step it resumes from and the ranks now, printed on every rank; None at the job's first start.

    Rank 0 counts the starts and keeps each start's nodes in the agent's store (the counter is the
    store's, so a node that joins with a fresh agent agrees with the others)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env or not dist.is_initialized():
        return None
    names: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(names, node_name())
    nodes = list(dict.fromkeys(str(n) for n in names))
    info: list[object] = [None]
    if dist.get_rank() == 0:
        info[0] = _count_start(env, nodes, output_dir=output_dir)
    dist.broadcast_object_list(info, src=0)
    if info[0] is None:
        return None
    start, before, step = info[0]  # pyright: ignore[reportGeneralTypeIssues]
    left = [n for n in before if n not in nodes]
    joined = [n for n in nodes if n not in before]
    change = ", ".join([f"node {n} left" for n in left] + [f"node {n} joined" for n in joined])
    world, was = dist.get_world_size(), len(before) * int(env.get("LOCAL_WORLD_SIZE", "1"))
    line = (
        f"recipes train: restart {start - 1} of this job: {change or 'the same nodes restarted'} "
        f"({len(before)} -> {len(nodes)} nodes); resuming from {step} on {world} "
        f"rank{'s' if world != 1 else ''} (was {was})"
    )
    print(f"[rank {dist.get_rank()}] {line}", file=sys.stderr, flush=True)
    return line


def _count_start(
    env: Mapping[str, str], nodes: list[str], *, output_dir: str
) -> tuple[int, list[str], str] | None:
    """(this start's number, the nodes of the one before, the step resumed) after a restart, else None."""
    try:
        store = _job_store(env)
        if store is None:
            return None
        start = int(store.add("starts", 1))
        store.set(f"nodes/{start}", json.dumps(nodes))
        if start == 1:
            return None
        before = json.loads(store.get(f"nodes/{start - 1}").decode())
    except (RuntimeError, TimeoutError, ValueError):  # torch's DistStoreError / DistNetworkError
        return None  # the line is a report: a store that cannot say does not stop the run
    return start, before, _latest_step(output_dir)
