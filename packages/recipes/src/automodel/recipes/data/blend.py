"""Blends of several sample sets with weights, with Megatron's per-corpus sample counts.

For a blend of ``N`` samples, corpus ``d`` with normalised weight ``w_d`` contributes
``ceil(N * w_d)`` samples (megatron-core's ``_get_size_per_split_per_dataset``), so the blend
holds ``sum_d ceil(N * w_d)`` samples and every count is fixed by the weights. Which samples of a
corpus are used is fixed by the seed: a keyed permutation of the corpus, repeated (with a new key
per pass) when a corpus is asked for more samples than it has. Without weights, each corpus
contributes all of its samples once (Megatron weights an unweighted list by corpus size).

The blend's positions list corpus 0's samples, then corpus 1's, ...; the sampler's global order
(a permutation per epoch) interleaves them, so Megatron's greedy interleaving is not reproduced
sample for sample, but the per-corpus counts are the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from automodel.recipes.data.sample_order import permute


def blend_counts(weights: Sequence[float], *, total: int) -> list[int]:
    """Samples per corpus for a blend of `total` samples: ``ceil(total * w / sum(w))`` each."""
    if not weights:
        raise ValueError("a blend needs at least one corpus")
    bad = [w for w in weights if not w > 0]
    if bad:
        raise ValueError(f"blend weights must be > 0, got {bad[0]}")
    s = float(sum(weights))
    return [int(math.ceil(total * (float(w) / s))) for w in weights]


class BlendedSamples:
    """Samples of several datasets (each with ``len`` and ``batch``) in fixed per-corpus counts."""

    def __init__(self, parts: Sequence[Any], *, counts: Sequence[int], seed: int) -> None:
        assert len(parts) == len(counts)
        for part, n in zip(parts, counts):
            if len(part) == 0 and n > 0:
                raise ValueError("a blended corpus has no samples")
        self.parts = list(parts)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.sizes = np.array([len(p) for p in parts], dtype=np.int64)
        self._ends = np.cumsum(self.counts)
        self.seed = seed
        self.seq_length = parts[0].seq_length

    def __len__(self) -> int:
        return int(self._ends[-1])

    def locate(self, indices: Sequence[int]) -> list[tuple[int, int]]:
        """(corpus, sample of that corpus) for blend positions `indices`."""
        pos = np.asarray(indices, dtype=np.int64)
        part = np.searchsorted(self._ends, pos, side="right")
        k = pos - (self._ends[part] - self.counts[part])
        out = []
        for d, kk in zip(part.tolist(), k.tolist()):
            size = int(self.sizes[d])
            if int(self.counts[d]) == size:  # the whole corpus once: its own order
                out.append((d, kk))
                continue
            sample = permute(np.array([kk % size]), n=size, seed=self.seed, epoch=kk // size, stream=2 + d)
            out.append((d, int(sample[0])))
        return out

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pieces = [self.parts[d].batch([j]) for d, j in self.locate(indices)]
        input_ids, labels, position_ids = (torch.cat(t) for t in zip(*pieces, strict=True))
        return input_ids, labels, position_ids
