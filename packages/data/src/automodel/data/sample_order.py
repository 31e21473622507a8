"""Global sample orders that are functions of (seed, epoch) alone, computed per index in O(1) memory.

`StatefulGlobalBatchSampler` asks an order for positions ``[start, stop)`` of an epoch; the dp
ranks slice the same answer, so every layout sees the same global batches and a resume needs only
(epoch, position). `ShuffledOrder` is a keyed pseudo-random permutation (a Feistel network with
cycle walking): index ``i`` maps to ``perm(i)`` without materialising the permutation, so neither
start-up nor memory grows with the number of samples. `SequentialOrder` reads in stored order
(optionally with its blocks, e.g. shard files, shuffled per epoch: `BlockShuffledOrder`).
`StoredThenShuffledOrder` keeps a dataset's own order (megatron-core's, already shuffled) for the
first pass and shuffles later passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective, well-mixing hash of uint64 values."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int, stream: int, rounds: int) -> list[np.uint64]:
    with np.errstate(over="ignore"):
        return _keys(seed, epoch, stream, rounds)


def _keys(seed: int, epoch: int, stream: int, rounds: int) -> list[np.uint64]:
    base = _mix(
        np.array(
            [(seed * 0x9E3779B1 + epoch * 0x85EBCA77 + stream * 0xC2B2AE3D) & 0xFFFFFFFFFFFFFFFF],
            dtype=np.uint64,
        )
    )[0]
    return [_mix(np.array([base + np.uint64(r + 1)], dtype=np.uint64))[0] for r in range(rounds)]


def permute(indices: np.ndarray, *, n: int, seed: int, epoch: int, stream: int = 0) -> np.ndarray:
    """``perm(indices)`` for the keyed permutation of ``range(n)`` chosen by (seed, epoch, stream)."""
    idx = np.asarray(indices, dtype=np.uint64)
    if n <= 1:
        return idx.astype(np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # domain 4^half >= n, so < 4n: few cycle walks
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = _round_keys(seed, epoch, stream, rounds=4)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in keys:
            with np.errstate(over="ignore"):
                f = _mix(right ^ key) & mask
            left, right = right, left ^ f
        return (left << shift) | right

    out = encrypt(idx)
    todo = out >= np.uint64(n)
    while todo.any():  # cycle walking: re-encrypt until back inside range(n) (a bijection on it)
        out[todo] = encrypt(out[todo])
        todo = out >= np.uint64(n)
    return out.astype(np.int64)


class SampleOrder(Protocol):
    """Which dataset indices the global sample positions ``start..stop`` of `epoch` read."""

    n: int

    def indices(self, *, epoch: int, start: int, stop: int) -> list[int]: ...


class ShuffledOrder:
    """A fresh pseudo-random permutation of ``range(n)`` per epoch, from (seed, epoch)."""

    def __init__(self, n: int, *, seed: int) -> None:
        self.n, self.seed = n, seed

    def indices(self, *, epoch: int, start: int, stop: int) -> list[int]:
        return permute(np.arange(start, stop), n=self.n, seed=self.seed, epoch=epoch).tolist()


class SequentialOrder:
    """Stored order every epoch."""

    def __init__(self, n: int) -> None:
        self.n = n

    def indices(self, *, epoch: int, start: int, stop: int) -> list[int]:
        return list(range(start, stop))


class StoredThenShuffledOrder:
    """Epoch 0 in stored order (a dataset already in megatron-core's shuffled order, so a run
    reads exactly what Megatron-LM would); every later epoch a keyed permutation of (seed, epoch)."""

    def __init__(self, n: int, *, seed: int) -> None:
        self.n, self.seed = n, seed

    def indices(self, *, epoch: int, start: int, stop: int) -> list[int]:
        if epoch == 0:
            return list(range(start, stop))
        return permute(np.arange(start, stop), n=self.n, seed=self.seed, epoch=epoch).tolist()


class BlockShuffledOrder:
    """Blocks (e.g. shard files) of the given sizes in an order shuffled per epoch; in-block order kept."""

    def __init__(self, block_sizes: Sequence[int], *, seed: int) -> None:
        self.sizes = np.asarray(block_sizes, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.n = int(self.sizes.sum())
        self.seed = seed

    def indices(self, *, epoch: int, start: int, stop: int) -> list[int]:
        order = permute(np.arange(len(self.sizes)), n=len(self.sizes), seed=self.seed, epoch=epoch, stream=1)
        sizes = self.sizes[order]
        ends = np.cumsum(sizes)
        pos = np.arange(start, stop)
        block = np.searchsorted(ends, pos, side="right")
        within = pos - (ends[block] - sizes[block])
        return (self.starts[order[block]] + within).tolist()
