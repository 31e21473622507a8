"""Write a Megatron ``<prefix>.bin`` + ``<prefix>.idx`` pair, one document at a time.

Tokens stream to the ``.bin`` as they come; the index (4 + 8 bytes per document) is written at
`finalize`. Each document is one sequence (megatron-core's preprocessing without sentence
splitting), so ``document_indices`` is ``0, 1, ..., n``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from automodel.data.megatron_index import write_index


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest integer dtype holding ids ``0 .. vocab_size - 1`` (uint8, uint16 or int32)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 31:
        return np.dtype(np.int32)
    return np.dtype(np.int64)


class MegatronWriter:
    """``add_document(ids)`` ... ``finalize()``; ids must fit `dtype` (checked per document).

    Writes go to ``<bin_path or prefix.bin>``; ``bin_sha256`` hashes what was written (for manifests).
    """

    def __init__(self, prefix: str | Path, *, dtype: np.dtype, bin_path: str | Path | None = None) -> None:
        self.prefix = str(prefix)
        self.bin_sha256 = hashlib.sha256()
        self.dtype = np.dtype(dtype)
        self._max = np.iinfo(self.dtype).max
        self._bin = Path(bin_path or self.prefix + ".bin").open("wb")
        self._lengths: list[int] = []
        self.num_tokens = 0

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(ids)
        if arr.size and (int(arr.max()) > self._max or int(arr.min()) < 0):
            raise ValueError(
                f"{self.prefix}.bin: token id {int(arr.max())} does not fit the shard dtype {self.dtype}"
            )
        data = arr.astype(self.dtype, copy=False).tobytes()
        self._bin.write(data)
        self.bin_sha256.update(data)
        self._lengths.append(int(arr.size))
        self.num_tokens += int(arr.size)

    def add_documents(self, docs: Sequence[Sequence[int] | np.ndarray], *, bos: int | None, eos: int) -> None:
        """Each of `docs` as ``[bos] ids eos`` (bos when given), written with one write per call."""
        if not docs:
            return
        head = [] if bos is None else [bos]
        pieces: list[Any] = []
        lengths = []
        for ids in docs:
            pieces += [head, ids, [eos]] if head else [ids, [eos]]
            lengths.append(len(ids) + 1 + len(head))
        flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
        if int(flat.max()) > self._max or int(flat.min()) < 0:
            raise ValueError(
                f"{self.prefix}.bin: token id {int(flat.max())} does not fit the shard dtype {self.dtype}"
            )
        data = flat.astype(self.dtype).tobytes()
        self._bin.write(data)
        self.bin_sha256.update(data)
        self._lengths += lengths
        self.num_tokens += int(flat.size)

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def finalize(self, idx_path: str | Path | None = None) -> None:
        """Close the ``.bin`` and write the ``.idx`` (the pair is readable only after this)."""
        self._bin.close()
        write_index(
            idx_path or self.prefix + ".idx",
            dtype=self.dtype,
            lengths=np.asarray(self._lengths, dtype=np.int32),
            document_indices=np.arange(len(self._lengths) + 1, dtype=np.int64),
        )
