"""nanoGPT token files: modded-nanogpt's ``.bin`` (256 x int32 header) and headerless flat uint16.

Header (int32 little-endian): ``[0]`` magic, ``[1]`` version 1, ``[2]`` token count, ``[3]`` bytes
per token. Magic 20240520 (modded-nanogpt's fineweb.py) means uint16 tokens; magic 278895051
(NeMo AutoModel's nanogpt_data_processor.py) takes the token size from ``[3]`` (2 or 4). A file
that starts with neither magic is nanoGPT's ``prepare.py`` output: flat uint16, no header, unless
its first 1024 bytes read as a header whose token count matches the file's size: that is a header
with a damaged magic, refused (read as data, its 512 header tokens would be trained on).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from automodel.data.corpus_error import CorpusError
from automodel.data.file_tokens import FileTokens

LEGACY_MAGIC = 20240520
MAGIC = 278895051
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


class NanogptShard:
    """One shard: ``tokens(start, stop)``; ``header`` says which layout it has."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise CorpusError(path, "does not exist")
        size = path.stat().st_size
        head = np.fromfile(path, dtype="<i4", count=min(4, size // 4))
        self.path = path
        self.header = head.size >= 4 and int(head[0]) in (MAGIC, LEGACY_MAGIC)
        if self.header:
            if int(head[1]) != VERSION:
                raise CorpusError(path, f"has nanoGPT header version {int(head[1])}; only {VERSION} is read")
            itemsize = 2 if int(head[0]) == LEGACY_MAGIC else int(head[3])
            if itemsize not in (2, 4):
                raise CorpusError(path, f"header says {itemsize} bytes per token; 2 or 4 are read")
            self.dtype = np.dtype("<u2" if itemsize == 2 else "<u4")
            self.num_tokens = int(head[2])
            need = HEADER_BYTES + self.num_tokens * itemsize
            if size < need:
                raise CorpusError(
                    path,
                    f"is truncated: {size} bytes, its header announces {self.num_tokens} tokens ({need} bytes)",
                )
            if size > need:
                raise CorpusError(
                    path, f"is {size} bytes, more than its header's {self.num_tokens} tokens ({need})"
                )
            offset = HEADER_BYTES
        else:
            _refuse_damaged_header(path, head, size)
            if size % 2:
                raise CorpusError(
                    path, f"is {size} bytes: not a whole number of uint16 tokens (and no nanoGPT header)"
                )
            self.dtype = np.dtype("<u2")
            self.num_tokens = size // 2
            offset = 0
        if self.num_tokens == 0:
            raise CorpusError(path, "holds no tokens")
        self._tokens = FileTokens(path, dtype=self.dtype, offset=offset, num_tokens=self.num_tokens)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self._tokens.tokens(start, stop)


def _refuse_damaged_header(path: Path, head: np.ndarray, size: int) -> None:
    """A file whose header fields (version 1, token count x 2 or 4 bytes + 1024 = its size) are
    those of a nanoGPT header but whose magic is neither known one: refuse it, naming the magic."""
    if head.size < 4 or size < HEADER_BYTES:
        return
    magic, version, count, itemsize = (int(v) for v in head[:4])
    sizes = {count * 2, count * itemsize} if itemsize in (2, 4) else {count * 2}
    if count <= 0 or size - HEADER_BYTES not in sizes:
        return
    raise CorpusError(
        path,
        f"has a nanoGPT header ({count} tokens, version {version}, matching its {size} bytes) with "
        f"magic {magic}, not {LEGACY_MAGIC} (modded-nanogpt) or {MAGIC} (NeMo AutoModel): "
        "a damaged header; rewrite the shard",
    )


def write_nanogpt_shard(path: str | Path, tokens: np.ndarray, *, header: bool = True) -> None:
    """Write `tokens` as modded-nanogpt's uint16 shard (legacy magic) or, without header, flat uint16."""
    arr = np.asarray(tokens)
    if arr.size and (int(arr.max()) > 0xFFFF or int(arr.min()) < 0):
        raise ValueError(f"{path}: token ids must fit uint16")
    with Path(path).open("wb") as f:
        if header:
            head = np.zeros(HEADER_INTS, dtype="<i4")
            head[:4] = (LEGACY_MAGIC, VERSION, arr.size, 2)
            f.write(head.tobytes())
        f.write(arr.astype("<u2").tobytes())
