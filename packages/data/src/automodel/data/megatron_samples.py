"""One corpus split's samples in megatron-core ``GPTDataset`` order (`megatron_order`), read on demand.

Position ``i`` is megatron-core's ``GPTDataset[i]``: window ``shuffle[i]`` of the documents
concatenated in document-index order, ``seq_length + 1`` tokens, read from the ``.bin`` document
piece by document piece (positioned reads: only the rows asked for, on the rank that asks).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from automodel.data.megatron_corpus import MegatronCorpus
from automodel.data.megatron_order import GptOrder
from automodel.data.packing import split_rows
from automodel.data.sample_order import SampleOrder


class MegatronSamples:
    """``len`` samples; ``sample(i)`` the ``seq_length + 1`` tokens; ``batch(indices)`` the rows."""

    def __init__(
        self,
        corpus: MegatronCorpus,
        order: GptOrder,
        *,
        seq_length: int,
        eos_token_id: int,
        document_boundaries: bool,
        name: str,
    ) -> None:
        self.corpus = corpus
        self.order = order
        self.seq_length = seq_length
        self.eos_token_id = eos_token_id
        self.document_boundaries = document_boundaries
        self.name = name
        self._itemsize = corpus.dtype.itemsize
        #: the training sampler's order over these positions (set by the builder)
        self.sample_order: SampleOrder | None = None

    def __len__(self) -> int:
        return self.order.num_samples

    def _pieces(self, i: int) -> list[tuple[int, int]]:
        """``(first token in the .bin, count)`` of each document piece sample `i` reads."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        pos = int(self.order.shuffle_index[i]) * self.seq_length
        need = self.seq_length + 1
        starts, docs = self.order.document_starts, self.order.document_index
        slot = int(np.searchsorted(starts, pos, side="right")) - 1
        offset = pos - int(starts[slot])
        pieces = []
        pointers = self.corpus.index.pointers
        while need > 0:
            length = int(starts[slot + 1] - starts[slot]) - offset
            take = min(length, need)
            if take > 0:
                pieces.append((int(pointers[int(docs[slot])]) // self._itemsize + offset, take))
                need -= take
            slot, offset = slot + 1, 0
        return pieces

    def sample(self, i: int) -> np.ndarray:
        pieces = [self.corpus.tokens(first, first + take) for first, take in self._pieces(i)]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def token_location(self, i: int, position: int) -> tuple[str, int]:
        """(.bin file, token offset in it) of token `position` of sample `i` (for errors)."""
        for first, take in self._pieces(i):
            if position < take:
                return str(self.corpus.bin_path), first + position
            position -= take
        raise IndexError(f"position beyond sample {i}")

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = np.stack([self.sample(int(i)).astype(np.int64) for i in indices])
        return split_rows(
            torch.from_numpy(rows),
            eos_token_id=self.eos_token_id,
            document_boundaries=self.document_boundaries,
        )
