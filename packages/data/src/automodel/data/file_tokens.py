"""Token ranges of a flat token file, read with ``pread`` into fresh arrays.

Reading a sample copies its bytes and nothing else: a memory map would leave every page it faulted
in (and the kernel's read-around of each fault) mapped into the rank, so its RSS would grow with
the samples read (measured: ~1-2 MB per random 4 KB sample here). Positioned reads also need no
shared file offset, so forked ranks and threads can read one descriptor.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class FileTokens:
    """``tokens(start, stop)`` of `num_tokens` tokens of `dtype` stored from byte `offset` of `path`."""

    def __init__(self, path: str | Path, *, dtype: np.dtype, offset: int, num_tokens: int) -> None:
        self.path = str(path)
        self.dtype = np.dtype(dtype)
        self.offset = offset
        self.num_tokens = num_tokens
        self._fd: int | None = None
        self._pid = -1

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # one descriptor per process
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def tokens(self, start: int, stop: int) -> np.ndarray:
        start, stop = max(0, start), min(stop, self.num_tokens)
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        size = self.dtype.itemsize
        data = os.pread(self._descriptor(), (stop - start) * size, self.offset + start * size)
        if len(data) != (stop - start) * size:
            raise OSError(f"{self.path}: short read at token {start} (file changed while training?)")
        return np.frombuffer(data, dtype=self.dtype)

    def __del__(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
