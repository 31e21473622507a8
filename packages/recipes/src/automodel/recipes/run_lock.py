"""One run per ``output_dir``: an exclusive lock on ``<output_dir>/.lock`` that names its holder.

Two runs writing the same directory interleave ``metrics.jsonl``, delete each other's
checkpoints in progress and leave weights from one run beside the ``config.yaml`` of the other.
The lock is a `fcntl.flock` (the kernel drops it when its holder dies, however it dies); the file
holds the holder's host, pid, start time and command so a refusal can say who has it. A file left
by a holder that died is taken over with a line saying so.

`recipes train` takes the lock in the launcher, before any rank starts; rank 0 takes it itself
when the job was started some other way (torchrun directly, the Python API), and finds it already
held by its own launcher otherwise (the holder is one of its ancestors).
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

from automodel.recipes.errors import ConfigError
from automodel.recipes.lifetime import is_alive, is_ancestor

LOCK_FILE = ".lock"


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


def _prepare_dir(output_dir: Path) -> None:
    """`output_dir` as a writable directory, or a `ConfigError` saying why not (before any launch)."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError("output_dir", str(output_dir), "is a file, not a directory")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("output_dir", str(output_dir), f"cannot be created: {e.strerror}") from None


def acquire_output_lock(output_dir: str | Path) -> OutputDirLock | None:
    """Lock `output_dir` for this run; None when an ancestor of this process (its launcher) holds it.

    Raises `ConfigError` (key ``output_dir``) when another live run holds it, when the directory is a
    file, or cannot be created or written (read-only file system, permissions, full disk).
    """
    out = Path(output_dir)
    _prepare_dir(out)
    path = out / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        why = "is on a read-only file system" if e.errno == errno.EROFS else f"is not writable: {e.strerror}"
        raise ConfigError("output_dir", str(out), why) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        ours = holder is not None and holder.host == socket.gethostname()
        if ours and (holder.pid == os.getpid() or is_ancestor(holder.pid)):
            return None  # our own launcher (or this process, training in place) holds it
        who = holder.describe() if holder else "another process (its lock file names no holder)"
        raise ConfigError(
            "output_dir",
            str(out),
            f"is in use by another run: {who}. Wait for it to end, stop it, or pick another --output_dir",
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
        raise ConfigError("output_dir", str(out), f"is not writable: {e.strerror}") from None
    return OutputDirLock(path, fd)


@contextlib.contextmanager
def hold_output_dir(output_dir: str | Path, *, rank: int) -> Iterator[None]:
    """Rank 0 holds the lock while the block runs (see `acquire_output_lock`). Collective: every
    rank raises the same `ConfigError` when rank 0 cannot take it."""
    import torch.distributed as dist

    lock, error = None, None
    if rank == 0:
        try:
            lock = acquire_output_lock(output_dir)
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
