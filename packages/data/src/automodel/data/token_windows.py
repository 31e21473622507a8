"""Fixed-length samples of ``seq_length + 1`` tokens cut from token spans, read on demand.

A span is a contiguous token range of one memory-mapped source (a nanoGPT shard; Megatron corpora
have their own order, `megatron_samples`). Sample ``i`` of a span starts ``i * stride`` tokens in
(modded-nanogpt uses ``stride = seq_length + 1``). With
explicit ``starts`` (nanoGPT's ``align_to_bos``) each sample begins at a given offset instead.

Nothing is precomputed beyond one count per span, so a dataset over any number of tokens opens
in constant time and memory; `batch` reads only the rows asked for (each rank its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from automodel.data.packing import split_rows
from automodel.data.sample_order import SampleOrder


class TokenSource(Protocol):
    def tokens(self, start: int, stop: int) -> np.ndarray: ...


@dataclass(frozen=True)
class TokenSpan:
    """Tokens ``[start, stop)`` of `source`; `name` (a file) is what errors and reports cite."""

    source: TokenSource
    start: int
    stop: int
    name: str
    starts: np.ndarray | None = None  # explicit sample offsets (relative to `start`), else strided

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


def windows_in(span: TokenSpan, *, window: int, stride: int) -> int:
    """How many samples of `window` tokens fit in `span`."""
    if span.starts is not None:
        return int(span.starts.shape[0])
    n = span.num_tokens
    return 0 if n < window else (n - window) // stride + 1


class TokenWindows:
    """``len`` samples over `spans`; ``batch(indices)`` -> (input_ids, labels, position_ids)."""

    def __init__(
        self,
        spans: Sequence[TokenSpan],
        *,
        seq_length: int,
        stride: int,
        eos_token_id: int,
        document_boundaries: bool,
    ) -> None:
        self.spans = list(spans)
        self.seq_length = seq_length
        self.window = seq_length + 1
        self.stride = stride
        self.eos_token_id = eos_token_id
        self.document_boundaries = document_boundaries
        self.span_sizes = np.array(
            [windows_in(s, window=self.window, stride=stride) for s in self.spans], dtype=np.int64
        )
        self._ends = np.cumsum(self.span_sizes)
        #: the training sampler's order over these windows (set by the dataset kind's builder)
        self.sample_order: SampleOrder | None = None

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def token_offset(self, i: int) -> tuple[int, int]:
        """(span number, first token offset in its source) of sample `i`."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        s = int(np.searchsorted(self._ends, i, side="right"))
        k = i - int(self._ends[s] - self.span_sizes[s])
        span = self.spans[s]
        rel = int(span.starts[k]) if span.starts is not None else k * self.stride
        return s, span.start + rel

    def token_location(self, i: int, position: int) -> tuple[str, int]:
        """(file, token offset in it) of token `position` of sample `i` (for errors)."""
        s, off = self.token_offset(i)
        return self.spans[s].name, off + position

    def sample(self, i: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample `i`."""
        s, off = self.token_offset(i)
        return self.spans[s].source.tokens(off, off + self.window)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = np.stack([self.sample(int(i)).astype(np.int64) for i in indices])
        return split_rows(
            torch.from_numpy(rows),
            eos_token_id=self.eos_token_id,
            document_boundaries=self.document_boundaries,
        )
