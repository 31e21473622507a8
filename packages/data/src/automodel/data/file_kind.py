"""Why a path cannot be read as a file: checked before launch, so a rank never meets it as a traceback.

Root reads any file whatever its mode, so mode 000 refuses only other users (``cannot be read
(Permission denied)``); the cases that stop root too are the kinds: a directory, a FIFO or socket
(opening a FIFO with no writer would block the run forever), a dangling symbolic link.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def unreadable_file(path: Path) -> str | None:
    """What keeps `path` from being read as a regular file (``"is a directory, not a file"``), or None.

    It is opened (and closed at once) only when it is a regular file, so the check never blocks."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return f"is a dangling symbolic link (to {os.readlink(path)})"
        return "does not exist"
    except OSError as e:  # a parent directory this user cannot enter, a loop of links
        return f"cannot be reached ({e.strerror or e})"
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    if not stat.S_ISREG(mode):
        return "is not a regular file (a FIFO, socket or device)"
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def os_error_line(err: OSError) -> str:
    """``<strerror>: <file>`` of a file-system error (with the errno name), e.g. disk full."""
    code = errno.errorcode.get(err.errno or 0, str(err.errno))
    where = f": {err.filename}" if err.filename else ""
    if err.filename2:
        where += f" -> {err.filename2}"
    return f"{err.strerror or err}{where} ({code})"
