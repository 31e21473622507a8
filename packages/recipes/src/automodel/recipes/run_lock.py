"""One run per ``output_dir``: an exclusive lock on ``<output_dir>/.lock`` that names its holder.

Two runs writing the same directory interleave ``metrics.jsonl``, delete each other's
checkpoints in progress and leave weights from one run beside the ``config.yaml`` of the other.
The lock is a `fcntl.flock` (the kernel drops it when its holder dies, however it dies); the file
holds the holder's host, pid, start time and command so a refusal can say who has it. A file left
by a holder that died is taken over with a line saying so.

`recipes train` takes the lock in the launcher, before any rank starts; rank 0 takes it itself
when the job was started some other way (torchrun directly, the Python API), and finds it already
held by its own launcher otherwise (the holder is one of its ancestors).

A ``checkpoint.checkpoint_dir`` outside ``output_dir`` is locked the same way (``<dir>/.lock``; names
starting with ``.`` are never checkpoints), so two runs with different output_dirs cannot share one.
A checkpoint directory inside ``output_dir`` is covered by the output_dir's lock; such a run still
checks that no other run holds it as its outside checkpoint_dir, and a run whose outside
checkpoint_dir lies inside another live run's output_dir is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from automodel.recipes.checkpoint.paths import checkpoint_root
from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.errors import ConfigError
from automodel.recipes.lifetime import is_alive, is_ancestor

LOCK_FILE = ".lock"
CHECKPOINT_KEY = "checkpoint.checkpoint_dir"


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str
    command: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started} ({self.command})"


def _this_holder() -> Holder:
    return Holder(
        host=socket.gethostname(),
        pid=os.getpid(),
        started=time.strftime("%Y-%m-%d %H:%M:%S %z"),
        command=" ".join(sys.argv)[:300] or sys.executable,
    )


def _read_holder(fd: int) -> Holder | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 65536)
    try:
        data = json.loads(raw.decode())
        return Holder(**{k: data[k] for k in ("host", "pid", "started", "command")})
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


class OutputDirLock:
    """The held lock; `release` (or process exit) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # an empty file: nobody to take over from
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _prepare_dir(directory: Path, *, key: str) -> None:
    """`directory` as a writable directory, or a `ConfigError` (key `key`) saying why not."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(key, str(directory), "is a file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(key, str(directory), f"cannot be created: {e.strerror}") from None


def acquire_output_lock(output_dir: str | Path) -> OutputDirLock | None:
    """Lock `output_dir` for this run; None when an ancestor of this process (its launcher) holds it.

    Raises `ConfigError` (key ``output_dir``) when another live run holds it, when the directory is a
    file, or cannot be created or written (read-only file system, permissions, full disk).
    """
    return _acquire(Path(output_dir), key="output_dir")


def run_checkpoint_dir(cfg: RecipeConfig) -> Path | None:
    """The checkpoint root a run writes (None when checkpointing is off), for `acquire_run_lock`."""
    if not cfg.checkpoint.enabled:
        return None
    return checkpoint_root(checkpoint_dir=cfg.checkpoint.checkpoint_dir, output_dir=cfg.output_dir)


class RunLock:
    """The locks of one run (output_dir, and an outside checkpoint_dir); `release` frees them all."""

    def __init__(self, locks: list[OutputDirLock]) -> None:
        self.locks = locks

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []


def acquire_run_lock(*, output_dir: str | Path, checkpoint_dir: str | Path | None) -> RunLock:
    """Lock `output_dir` and, when it lies outside it, `checkpoint_dir` (the checkpoint root this run
    writes; None when the run saves no checkpoints). Refusals are `ConfigError`s naming the key
    (``output_dir`` or ``checkpoint.checkpoint_dir``) and the holder."""
    out = Path(output_dir)
    if checkpoint_dir is not None and Path(checkpoint_dir).exists() and not Path(checkpoint_dir).is_dir():
        raise ConfigError(CHECKPOINT_KEY, str(checkpoint_dir), "is a file, not a directory")
    held: list[OutputDirLock] = []
    try:
        lock = _acquire(out, key="output_dir")
        held += [lock] if lock is not None else []
        if checkpoint_dir is None:
            return RunLock(held)
        root = Path(checkpoint_dir)
        if _is_within(root, out):
            _refuse_if_held(root / LOCK_FILE, root=root, why="is the checkpoint_dir of another run")
            return RunLock(held)
        for above in root.resolve().parents:
            _refuse_if_held(
                above / LOCK_FILE, root=root, why=f"is inside {above}, the output_dir of another run"
            )
        lock = _acquire(root, key=CHECKPOINT_KEY)
        held += [lock] if lock is not None else []
        return RunLock(held)
    except BaseException:
        RunLock(held).release()
        raise


def _is_within(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def _refuse_if_held(lock_file: Path, *, root: Path, why: str) -> None:
    """A `ConfigError` for `root` when another live run (not this process or its launcher) holds the
    lock file `lock_file`; nothing when it does not exist, is free, or names no holder of ours."""
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            if holder is None or _ours(holder):
                return
            raise ConfigError(
                CHECKPOINT_KEY,
                str(root),
                f"{why}: {holder.describe()}. Wait for it to end, stop it, or pick another checkpoint_dir",
            ) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _ours(holder: Holder) -> bool:
    return holder.host == socket.gethostname() and (holder.pid == os.getpid() or is_ancestor(holder.pid))


def _acquire(out: Path, *, key: str) -> OutputDirLock | None:
    _prepare_dir(out, key=key)
    path = out / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        why = "is on a read-only file system" if e.errno == errno.EROFS else f"is not writable: {e.strerror}"
        raise ConfigError(key, str(out), why) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        if holder is not None and _ours(holder):
            return None  # our own launcher (or this process, training in place) holds it
        who = holder.describe() if holder else "another process (its lock file names no holder)"
        raise ConfigError(
            key,
            str(out),
            f"is in use by another run: {who}. Wait for it to end, stop it, or pick another --{key}",
        ) from None
    previous = _read_holder(fd)
    if previous is not None:
        gone = "is no longer running" if not (
            previous.host == socket.gethostname() and is_alive(previous.pid)
        ) else "no longer holds it"  # fmt: skip
        print(
            f"taking over the stale lock of {out}: its holder ({previous.describe()}) {gone}",
            file=sys.stderr,
            flush=True,
        )
    try:
        payload = json.dumps(_this_holder().__dict__).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, payload, 0)
        os.fsync(fd)
    except OSError as e:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        raise ConfigError(key, str(out), f"is not writable: {e.strerror}") from None
    return OutputDirLock(path, fd)


@contextlib.contextmanager
def hold_output_dir(
    output_dir: str | Path, *, rank: int, checkpoint_dir: str | Path | None = None
) -> Iterator[None]:
    """Rank 0 holds the run's locks while the block runs (see `acquire_run_lock`). Collective: every
    rank raises the same `ConfigError` when rank 0 cannot take them."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = acquire_run_lock(output_dir=output_dir, checkpoint_dir=checkpoint_dir)
        except ConfigError as e:
            error = (e.key, e.value, e.message)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(*error)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
