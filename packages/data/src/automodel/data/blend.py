"""Blends of several corpora with weights, in megatron-core ``BlendedDataset`` order.

Blend position ``s`` reads sample ``dataset_sample_index[s]`` of corpus ``dataset_index[s]``
(`blend_indices`: megatron-core's greedy interleave), each corpus being a `MegatronSamples` in its
own ``GPTDataset`` order. How many samples each corpus is built with follows
``BlendedMegatronDatasetBuilder``: for a blend of ``N`` samples with normalised weights ``w``, the
blend holds ``sum_d ceil(N * w_d)`` samples and corpus ``d`` is built with
``ceil(ceil(N * w_d) * (1 + 0.005))`` (its margin, ``mid_level_dataset_surplus``), repeating its
documents over as many epochs as that takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

#: megatron-core's ``mid_level_dataset_surplus`` default
MID_LEVEL_SURPLUS = 0.005


class BlendedSamples:
    """Position ``s`` -> sample ``dataset_sample_index[s]`` of ``parts[dataset_index[s]]``."""

    def __init__(
        self, parts: Sequence[Any], *, dataset_index: np.ndarray, dataset_sample_index: np.ndarray
    ) -> None:
        self.parts = list(parts)
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index
        self.seq_length = self.parts[0].seq_length
        self.sample_order: Any = None

    @property
    def counts(self) -> np.ndarray:
        return np.bincount(np.asarray(self.dataset_index), minlength=len(self.parts))

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def locate(self, indices: Sequence[int]) -> list[tuple[int, int]]:
        """(corpus, sample of that corpus) for blend positions `indices`."""
        return [(int(self.dataset_index[i]), int(self.dataset_sample_index[i])) for i in indices]

    def sample(self, i: int) -> np.ndarray:
        d, j = self.locate([i])[0]
        return self.parts[d].sample(j)

    def token_location(self, i: int, position: int) -> tuple[str, int]:
        """(file, token offset) of token `position` of blend position `i` (for errors)."""
        d, j = self.locate([i])[0]
        return self.parts[d].token_location(j, position)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pieces = [self.parts[d].batch([j]) for d, j in self.locate(indices)]
        input_ids, labels, position_ids = (torch.cat(t) for t in zip(*pieces, strict=True))
        return input_ids, labels, position_ids
