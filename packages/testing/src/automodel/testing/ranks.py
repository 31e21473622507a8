"""Multi-rank test harness: run a function on N real gloo ranks forked from this process.

Forking from the already-imported test process costs ~0.3 s per world instead of ~8 s for
torchrun. Every rank's result comes back to the caller; the first failing rank is re-raised
with its rank and traceback; a rank that hangs fails the call at the time-out instead of
hanging CI, and the failure carries every hung rank's Python stack (all threads), so a hang
seen once on CI can be diagnosed from its log.

Forked ranks are gloo/CPU only: a process that has initialised CUDA cannot fork ranks that use
it ("Cannot re-initialize CUDA in forked subprocess"). GPU tests therefore launch their ranks with
`run_torchrun` and decide what to skip with `cuda_device_count`, which never initialises CUDA in
the calling process.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _start_autograd_engine_on_cpu() -> None:
    """Run one tiny backward now, before anything can register device threads with autograd.

    The autograd engine starts its worker threads at the process's first backward, one per
    device it then knows of. After torch's fake-tensor mode has been entered (model tracing,
    `recipes validate`), that includes device threads, and a child forked after such a first
    backward cannot run backward at all ("Unable to handle autograd's threading in combination
    with fork-based multiprocessing"). A CPU-only first backward keeps forked ranks usable.
    """
    probe = torch.ones(1, requires_grad=True)
    (probe * 2).sum().backward()


_start_autograd_engine_on_cpu()


class RankFailure(RuntimeError):
    """A rank raised; carries the rank and its formatted traceback."""

    def __init__(self, rank: int, remote_traceback: str, failed_ranks: list[int]) -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.failed_ranks = failed_ranks
        super().__init__(f"rank {rank} failed (failed ranks so far: {failed_ranks}):\n{remote_traceback}")


class RankTimeout(RuntimeError):
    """Some ranks did not finish within the time-out."""


class TorchrunFailure(RuntimeError):
    """A `run_torchrun` job exited non-zero or ran past its time-out; carries the output's tail."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    host: str,
    port: int,
    timeout_s: float,
    args: tuple,
    kwargs: dict,
    conn: Any,
    stack_dump: str,
) -> None:
    status, payload = "ok", b""
    # Objects inherited from the parent are never collected here: a gloo group the parent left in
    # a reference cycle would run its destructor in this rank, which joins worker threads a forked
    # child does not have, and the rank hangs "Garbage-collecting" (seen on CI, late in a full run).
    gc.freeze()
    try:
        # Kept open for the life of the process: faulthandler writes to its descriptor on SIGUSR1
        # (the parent asks for a hung rank's stacks) and on a fatal signal (a native crash: SIGABRT
        # from glibc's heap checks, SIGSEGV), so a rank that dies without reporting still says where.
        dump_file = open(stack_dump, "w")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
        faulthandler.enable(file=dump_file, all_threads=True)
        torch.set_num_threads(1)
        # Rank 0 binds port 0 (the OS picks a free one, no race with other jobs) and tells the parent,
        # which only then forks the other ranks with that port.
        store = dist.TCPStore(
            host,
            port,
            world_size=world_size,
            is_master=rank == 0,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
        if rank == 0:
            port = store.port
            conn.send(("port", 0, port))
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR=host,
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        result = fn(*args, **kwargs)
        payload = pickle.dumps(result)
        if dist.is_initialized():  # `fn` may end the group itself (the `recipes train` command does)
            dist.barrier()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        status, payload = "error", traceback.format_exc().encode()
    try:
        conn.send((status, rank, payload))
        conn.close()
    finally:
        if status == "ok" and dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)


def run_on_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on `world_size` gloo ranks; return the results in rank order.

    Each rank is a forked child with an initialized default process group (gloo, one intra-op
    thread, ``RANK``/``WORLD_SIZE`` set as torchrun would). `fn` and its results must be
    picklable; `fn` must be defined at module level or be otherwise reachable after fork.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if dist.is_initialized():
        raise RuntimeError("run_on_ranks must be called from a process without a process group")
    kwargs = kwargs or {}
    host, port = "127.0.0.1", 0
    ctx = mp.get_context("fork")
    procs: list = []
    conns: list = []
    stack_dir = tempfile.TemporaryDirectory(prefix="automodel-ranks-")
    dumps = [str(Path(stack_dir.name) / f"rank{rank}.stack") for rank in range(world_size)]
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, host, port, timeout_s, args, kwargs, child_conn, dumps[rank]),
                daemon=True,
            )
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)
            if rank == 0:
                port = _receive_store_port(procs[0], conns[0], timeout_s)
        try:
            return _collect(procs, conns, timeout_s, dumps)
        except RankTimeout as exc:
            raise RankTimeout(f"{exc}\n{_hung_stacks(procs, dumps)}") from None
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=5)
        stack_dir.cleanup()


def _hung_stacks(procs: list, dumps: list[str], wait_s: float = 2.0) -> str:
    """Ask every live rank for its Python stacks (faulthandler on SIGUSR1) and return them as text."""
    alive = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in alive:
        os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(wait_s)
    parts = []
    for rank in alive:
        text = Path(dumps[rank]).read_text(errors="replace").strip() if Path(dumps[rank]).exists() else ""
        parts.append(f"--- rank {rank} stacks at the time-out ---\n{text or '(no stack written)'}")
    return "\n".join(parts)


def _receive_store_port(proc: Any, conn: Any, timeout_s: float) -> int:
    """Rank 0 hosts the store (the parent keeps no server thread, so forking stays safe)."""
    if not conn.poll(timeout_s):
        raise RankTimeout(f"rank 0 did not start its store within {timeout_s:.0f} s")
    try:
        kind, _, value = conn.recv()
    except EOFError:
        raise RankFailure(0, f"rank 0 died while starting (exit code {proc.exitcode})", [0]) from None
    if kind == "error":
        raise RankFailure(0, value.decode(), [0])
    return value


def _died_without_reporting(rank: int, proc: Any, dump: str) -> str:
    """What is known of a rank that exited before sending its result: its exit code (a negative
    code is the signal that ended it) and the Python stacks faulthandler wrote at a fatal signal."""
    proc.join(timeout=1)
    code = proc.exitcode
    how = f"exit code {code}"
    if code is not None and code < 0:
        try:
            how += f", {signal.Signals(-code).name}"
        except ValueError:
            pass
    text = Path(dump).read_text(errors="replace").strip() if Path(dump).exists() else ""
    return f"rank {rank} died without reporting ({how})" + (
        f"\n--- rank {rank} stacks at its fatal signal ---\n{text}" if text else ""
    )


def _collect(procs: list, conns: list, timeout_s: float, dumps: list[str]) -> list[Any]:
    world_size = len(procs)
    results: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout_s
    pending = set(range(world_size))
    while pending:
        wait_s = max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait([conns[r] for r in pending], timeout=wait_s)
        if not ready:
            raise RankTimeout(
                f"ranks {sorted(pending)} of {world_size} did not finish within {timeout_s:.0f} s "
                f"(finished: {sorted(results)}); they were killed"
            )
        for conn in ready:
            rank = conns.index(conn)
            pending.discard(rank)
            try:
                status, _, payload = conns[rank].recv()
            except EOFError:
                failures.append((rank, _died_without_reporting(rank, procs[rank], dumps[rank])))
                break
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                failures.append((rank, payload.decode()))
        if failures:
            # The first failure is the cause; others are usually peers losing their connection.
            rank, tb = failures[0]
            raise RankFailure(rank, tb, [r for r, _ in failures])
    return [results[r] for r in range(world_size)]


_CUDA_PROBE = (
    "import torch\n"
    "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    "print(n, torch.__version__, torch.version.cuda)\n"
)


@functools.cache
def _probe_cuda_in_child() -> tuple[int, str]:
    """(device count, why) as a fresh interpreter sees it; run once per process."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CUDA_PROBE], capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return 0, f"the CUDA probe process failed to run: {err}"
    words = proc.stdout.split()
    if proc.returncode != 0 or len(words) != 3 or not words[0].isdigit():
        return 0, f"the CUDA probe process failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
    count, version, cuda = int(words[0]), words[1], words[2]
    if count == 0:
        return 0, f"torch {version} (CUDA {cuda}) sees no CUDA device: torch.cuda.is_available() is False"
    return count, f"torch {version} (CUDA {cuda}) sees {count} CUDA device(s)"


def cuda_probe() -> tuple[int, str]:
    """``(number of usable CUDA devices, a sentence saying so)``, without initialising CUDA here.

    ``torch.cuda.is_available()`` calls ``cudaGetDeviceCount``, which initialises the CUDA driver in
    the calling process; a test process that did so can no longer fork ranks that use CUDA. So
    unless CUDA is already initialised here (then torch is asked directly), a child interpreter
    answers, once per process (~2-3 s). A CPU-only torch build answers 0 without a child.
    """
    if torch.version.cuda is None and torch.version.hip is None:
        return 0, f"torch {torch.__version__} is a CPU-only build (no CUDA)"
    if torch.cuda.is_initialized():
        count = torch.cuda.device_count()
        return count, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees {count} CUDA device(s)"
    return _probe_cuda_in_child()


def cuda_device_count() -> int:
    """Usable CUDA devices, found without initialising CUDA in this process (see `cuda_probe`)."""
    return cuda_probe()[0]


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux /proc), parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid`, its process group and every descendant. torchrun starts each rank in a session
    of its own, so killing the launcher's group alone would leave the ranks running."""
    tree = _descendants(pid) if os.path.isdir("/proc") else []
    for target in (pid, *tree):
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_torchrun(
    script: str | os.PathLike[str],
    *,
    nproc_per_node: int,
    args: Sequence[str] = (),
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `script` under ``torchrun --standalone --nproc_per_node=N`` in a child process; return it.

    For ranks that need CUDA (NCCL), which `run_on_ranks` cannot fork. Past `timeout_s` the
    launcher, its ranks (each in a session of its own) and their children are killed, so a hung
    NCCL rank does not outlive the test holding a GPU. A non-zero exit or a time-out raises
    `TorchrunFailure` with the tail of the job's output. ``OMP_NUM_THREADS=1`` unless `env`
    (added to this process's environment) sets it.
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc_per_node}",
        str(script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # something still holds the pipes: give up on the output
            stdout, stderr = "", "(output lost: the job's pipes stayed open after the kill)"
        raise TorchrunFailure(
            f"torchrun {script} (nproc {nproc_per_node}) ran past {timeout_s:.0f} s and was killed\n"
            f"--- stdout (tail) ---\n{stdout[-4000:]}\n--- stderr (tail) ---\n{stderr[-4000:]}"
        ) from None
    if proc.returncode != 0:
        raise TorchrunFailure(
            f"torchrun {script} (nproc {nproc_per_node}) exited {proc.returncode}\n"
            f"--- stdout (tail) ---\n{stdout[-4000:]}\n--- stderr (tail) ---\n{stderr[-4000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
