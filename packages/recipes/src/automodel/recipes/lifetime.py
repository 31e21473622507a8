"""Process lifetime of `recipes train`: every process dies with the one that started it.

torchrun starts each rank in a session of its own, so a signal to the launcher's process group
never reaches the ranks, and a killed launcher used to leave them training (and saving) on their
own. Each process of the tree therefore asks the kernel for a parent-death signal
(``prctl(PR_SET_PDEATHSIG)``): the launcher's agent dies with the launcher, each rank with the agent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(*, expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux; False elsewhere).

    The request is tied to the parent as it is now: when the parent is already gone (it died
    between our fork and this call, so our parent is now init or a subreaper) or is not
    `expected_parent`, this process exits at once, as the signal would have made it.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    parent = os.getppid()
    if parent == 1 or (expected_parent is not None and parent != expected_parent):
        os._exit(128 + int(sig))
    return True


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0], ppid [1]); None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rpartition(")")[2].split()


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def is_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not Path("/proc").is_dir()  # no /proc: kill(0) succeeded, so it exists
    return fields[0] not in ("Z", "X")


def is_ancestor(pid: int, *, of: int | None = None) -> bool:
    """Whether `pid` is the parent, grandparent, ... of `of` (this process by default)."""
    current = os.getpid() if of is None else of
    for _ in range(64):
        parent = parent_of(current)
        if parent is None or parent <= 1:
            return False
        if parent == pid:
            return True
        current = parent
    return False


def children_of(pid: int) -> list[int]:
    """The live direct children of `pid` (a scan of /proc; empty where there is none)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields and int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def descendants_of(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...)."""
    out, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in children_of(p)]
        out += kids
        frontier = kids
    return out
