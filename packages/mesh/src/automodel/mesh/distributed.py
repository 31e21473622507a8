"""Process-group set-up and teardown for torchrun, SLURM `srun` and a plain single process."""

from __future__ import annotations

import gc
import os
import re
import socket
import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from automodel.mesh.torch_internals import clear_process_group_registry, fake_store


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class LaunchEnv:
    """Rank/world/rendezvous as read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "single"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``node[07-09,12],gpu3`` -> ``node07``), as
    ``scontrol show hostnames`` would print it first, without needing scontrol."""
    head = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if head is None or not head.group(1) and head.group(2) is None:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    prefix, ranges = head.group(1), head.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_master_addr(env: Mapping[str, str]) -> str:
    """Rank 0's host: the first node of the step's (else the job's) node list."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        return first_host(nodelist)
    return env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")


def is_srun_task(env: Mapping[str, str]) -> bool:
    """True in a task that `srun` started: srun sets SLURM_STEP_ID and SLURM_PROCID. The shell of
    an ``sbatch`` / ``salloc`` allocation has SLURM_JOB_ID, SLURM_NTASKS and (sbatch) SLURM_PROCID=0
    but no step id: it is one process, not a rank."""
    return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank and rendezvous from torchrun's variables (RANK and WORLD_SIZE) or those of an
    `srun` task (`is_srun_task`; world size SLURM_STEP_NUM_TASKS, else SLURM_NTASKS); anything else,
    an sbatch shell included, is a plain process of world 1."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            launcher="torchrun",
        )
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if is_srun_task(env) and tasks:
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(tasks),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or _slurm_master_addr(env),
            master_port=int(env.get("MASTER_PORT") or 20000 + job_id % 20000),
            launcher="slurm",
        )
    return LaunchEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=_free_port(),
        launcher="single",
    )


class RendezvousError(RuntimeError):
    """This process cannot host or reach its job's rendezvous store; one line naming the address,
    where it came from and the cause (a port in use, nobody listening)."""

    def __init__(self, launch: LaunchEnv, *, hosts: bool, cause: BaseException) -> None:
        source = {
            "torchrun": "MASTER_ADDR / MASTER_PORT",
            "slurm": "MASTER_ADDR or the first node of SLURM_STEP_NODELIST; MASTER_PORT or 20000 + SLURM_JOB_ID % 20000",
            "single": "a free port picked for this process",
        }[launch.launcher]
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[-1][:300]
        where = f"{launch.master_addr}:{launch.master_port}"
        what = (
            f"rank 0 cannot host the rendezvous at {where} (from {source}): {reason}; pick a free MASTER_PORT"
            if hosts
            else f"rank {launch.rank} cannot reach the rendezvous at {where} (from {source}): {reason}; "
            "is rank 0 running?"
        )
        super().__init__(what)


def _rendezvous_store(launch: LaunchEnv, *, timeout_minutes: float) -> dist.Store:
    """The store the process group meets on, private to this (re)start of the job.

    Under torchrun the elastic agent hosts the store and keeps it across restarts
    (``--max-restarts``); without a per-attempt prefix, restarted ranks would read the gloo
    addresses that the killed generation left there and fail with "connection refused". A store
    rank 0 hosts itself (torchrun's c10d rendezvous with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a
    fresh one on a fresh port at every restart) needs no prefix, and takes none: the restart count
    is each agent's own, so a node that joins with a new agent would count differently.
    """
    # only a torchrun rank has an agent hosting the store (a leftover variable must not make a
    # plain process wait for a server nobody runs)
    agent_hosts_store = (
        launch.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    )
    hosts = launch.rank == 0 and not agent_hosts_store
    try:
        store = dist.TCPStore(
            launch.master_addr,
            launch.master_port,
            world_size=launch.world_size,
            is_master=hosts,
            timeout=timedelta(minutes=timeout_minutes),
            wait_for_workers=False,
        )
    except (RuntimeError, TimeoutError) as e:  # torch's DistNetworkError / DistStoreError
        raise RendezvousError(launch, hosts=hosts, cause=e) from e
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent_hosts_store else "0"
    return dist.PrefixStore(f"automodel/attempt_{attempt}", store)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(*, backend: str | None = None, timeout_minutes: float = 10.0) -> DistInfo:
    """Initialize the default process group for this process, or return it if already up.

    NCCL bound to the local rank's GPU when CUDA is present, gloo on CPU otherwise. Collectives
    that wait longer than `timeout_minutes` fail instead of hanging.
    """
    if timeout_minutes <= 0:
        raise ValueError(f"timeout_minutes must be > 0, got {timeout_minutes}")
    backend = backend or default_backend()
    if backend not in ("nccl", "gloo", "cpu:gloo,cuda:nccl"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    launch = detect_launch_env()
    device = torch.device("cpu")
    if "nccl" in backend:
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False; use 'gloo'")
        device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            store=_rendezvous_store(launch, timeout_minutes=timeout_minutes),
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timedelta(minutes=timeout_minutes),
            **({"device_id": device} if device.type == "cuda" else {}),
        )
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=launch.local_rank,
        backend=dist.get_backend(),
        device=device,
    )


def destroy_distributed(*, barrier: bool = True) -> None:
    """Tear the process groups down so that the process can exit cleanly: barrier, destroy, free.

    1. Barrier: destroying a group while a peer is still in a collective aborts that peer.
    2. ``destroy_process_group()``: unregisters every group. For gloo that is all it does: each
       ``ProcessGroupGloo`` keeps its worker threads until the C++ object itself is freed.
    3. Free the groups (`free_process_groups`), whose destructors join those threads.

    Step 3 is the rule behind "a finished training exits 0": no gloo worker may outlive the
    interpreter. A worker frees the tensors of a completed collective after the caller has moved
    on; when Python already dropped them, that needs the GIL. If the interpreter starts finalizing
    in between, Python ends the worker inside a C++ ``noexcept`` destructor and the rank dies with
    "terminate called without an active exception" (SIGABRT) after its last step.

    After a failure pass ``barrier=False``: peers may be stuck in a collective this rank will never
    join, and waiting for them would turn an error into a hang (the launcher then stops them). The
    groups are then left as they are, since freeing one waits for its queued collectives.
    """
    if not dist.is_initialized():
        return
    clean = barrier and dist.get_backend() != "fake"
    if clean:
        dist.barrier()
    dist.destroy_process_group()
    if clean:
        free_process_groups()


class HoldsProcessGroups(Protocol):
    """An object that keeps process groups alive (a pipeline's stages and schedule, say)."""

    def release_process_groups(self) -> None:
        """Drop every reference to a process group; the object is unusable afterwards."""
        ...


#: Objects whose groups `free_process_groups` releases; held weakly, so registering keeps nothing alive.
_GROUP_HOLDERS: weakref.WeakSet[HoldsProcessGroups] = weakref.WeakSet()


def release_groups_at_teardown(holder: HoldsProcessGroups) -> None:
    """Register `holder`: `destroy_distributed` calls its ``release_process_groups()`` before it frees
    the groups. For library objects a script keeps in scope until its end (``pipe``, built at module
    level and still alive when ``destroy_distributed()`` runs): their references would keep the
    groups, and the groups' gloo worker threads, alive past the teardown."""
    _GROUP_HOLDERS.add(holder)


def free_process_groups() -> None:
    """Free the destroyed process groups now, joining their gloo worker threads.

    Call after ``destroy_process_group()``. Whatever still references a group keeps it (and its
    threads) alive: objects registered with `release_groups_at_teardown` drop their references
    first (a pipeline the script still holds); our own objects (meshes, FSDP state, optimizers)
    usually sit in reference cycles, so they go with a collection; and each root ``DeviceMesh`` keeps its groups in
    ``_pg_registry`` while torch's DTensor caches (sharding propagation, redistribute plans) keep
    the meshes themselves alive until the process exits. Emptying those registries lets the groups
    go. The destructors run without the GIL, so a worker still freeing tensors finishes first.
    Objects frozen by ``gc.freeze()`` (a forked rank's inheritance) are not touched.
    """
    for holder in list(_GROUP_HOLDERS):
        holder.release_process_groups()
    _GROUP_HOLDERS.clear()
    for obj in gc.get_objects():
        # By type, not isinstance(): some torch objects warn when their class is inspected.
        if DeviceMesh in type(obj).__mro__:
            clear_process_group_registry(obj)
    gc.collect()
    left = gloo_worker_threads()
    if left:
        warnings.warn(
            f"{left} gloo worker threads outlive the destroyed process groups (something still "
            "references a group); the process may abort at exit with 'terminate called without an "
            "active exception'",
            RuntimeWarning,
            stacklevel=2,
        )


def gloo_worker_threads() -> int:
    """How many gloo collective worker threads this process runs (0 where /proc is unavailable)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return count


@contextmanager
def distributed_session(*, backend: str | None = None, timeout_minutes: float = 10.0) -> Iterator[DistInfo]:
    """`init_distributed` for the duration of a block, with clean teardown."""
    info = init_distributed(backend=backend, timeout_minutes=timeout_minutes)
    try:
        yield info
    except BaseException:
        destroy_distributed(barrier=False)
        raise
    destroy_distributed()


@contextmanager
def fake_world(world_size: int, *, rank: int = 0) -> Iterator[None]:
    """A process group of `world_size` ranks that exists only in this process (torch's fake backend).

    Meshes and groups are created as for a real job, so layouts far beyond this machine can be
    built and checked; collectives do nothing. Used by `recipes validate` and layout planning.
    """
    if dist.is_initialized():
        raise RuntimeError("fake_world needs no process group to be initialized in this process")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
