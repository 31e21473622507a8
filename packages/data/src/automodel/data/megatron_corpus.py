"""A Megatron ``<prefix>.bin`` + ``<prefix>.idx`` pair as one memory-mapped token stream.

Megatron's builder writes the sequences of a corpus back to back, so the ``.bin`` is one flat
token array and a run of sequences is one contiguous slice of it. Opening checks only what is
O(1) to check (header, sizes, the two ends agreeing with the ``.bin``), so start-up time and
memory do not grow with the corpus; a sample's tokens are read when it is (`file_tokens`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from automodel.data.corpus_error import CorpusError
from automodel.data.file_tokens import FileTokens
from automodel.data.megatron_index import MegatronIndex, read_index


def corpus_prefix(path: str | Path) -> str:
    """``x.bin`` / ``x.idx`` / ``x`` -> ``x`` (the prefix Megatron names a corpus by)."""
    s = str(path)
    return s[:-4] if s.endswith((".bin", ".idx")) else s


class MegatronCorpus:
    """Tokens of one Megatron corpus: ``tokens(start, stop)`` over the concatenated sequences."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = corpus_prefix(prefix)
        self.index: MegatronIndex = read_index(self.prefix + ".idx")
        bin_path = Path(self.prefix + ".bin")
        if not bin_path.is_file():
            raise CorpusError(bin_path, f"does not exist (its index {self.index.path} does)")
        idx, itemsize = self.index, self.index.dtype.itemsize
        size = bin_path.stat().st_size
        if idx.num_sequences == 0 or size == 0:
            raise CorpusError(bin_path, "is an empty corpus (no tokens)")
        last_end = int(idx.pointers[-1]) + int(idx.lengths[-1]) * itemsize
        if int(idx.pointers[0]) != 0 or last_end < size:
            raise CorpusError(
                bin_path,
                f"does not match {idx.path}: the index covers bytes {int(idx.pointers[0])}..{last_end}, "
                f"the file has {size} (not the .bin this .idx was written with?)",
            )
        if last_end > size:
            raise CorpusError(
                bin_path,
                f"is truncated: {size} bytes, its index {idx.path.name} needs {last_end} "
                f"({idx.num_sequences} sequences of {idx.dtype})",
            )
        self.bin_path = bin_path
        self.dtype = idx.dtype
        self.num_tokens = size // itemsize
        self._tokens = FileTokens(bin_path, dtype=self.dtype, offset=0, num_tokens=self.num_tokens)

    @property
    def num_sequences(self) -> int:
        return self.index.num_sequences

    def sequence_token_range(self, first: int, stop: int) -> tuple[int, int]:
        """Token offsets ``[start, end)`` of sequences ``first .. stop - 1`` in the stream."""
        n = self.num_sequences
        assert 0 <= first <= stop <= n, (first, stop, n)
        itemsize = self.dtype.itemsize
        start = int(self.index.pointers[first]) // itemsize if first < n else self.num_tokens
        end = int(self.index.pointers[stop]) // itemsize if stop < n else self.num_tokens
        return start, end

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream (read from the file now)."""
        return self._tokens.tokens(start, stop)

    def sequence(self, i: int) -> np.ndarray:
        """The tokens of sequence `i` (by its pointer and length, as megatron-core reads it)."""
        itemsize = self.dtype.itemsize
        start = int(self.index.pointers[i]) // itemsize
        return self._tokens.tokens(start, start + int(self.index.lengths[i]))
