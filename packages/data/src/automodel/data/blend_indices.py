"""megatron-core's blend interleaving (``helpers.build_blending_indices``), in numpy.

At blend position ``s`` the corpus with the largest sampling deficit ``w_d * max(s, 1) - c_d`` is
drawn (the first on ties), ``c_d`` being its samples drawn so far; the sample it gives is its
``c_d``-th. With ``caps`` (``build_exhaustive_blending_indices``: a blend without weights, sized by
the corpora) a corpus stops being drawn once it has given ``caps[d]`` samples, and the weights are
``caps / sum(caps)``. Nothing depends on the seed: the corpora's own orders are shuffled.

The greedy is sequential. For speed a stretch of positions is first guessed from a fixed priority
(corpus ``d``'s ``j``-th sample due at ``(c_d + j) / w_d``, exact for two corpora but for float
ties), then checked against the rule with the same float64 arithmetic as megatron-core's C++; the
checked prefix is kept, and where guesses fail often a plain loop takes over for a while.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def normalize(weights: Sequence[float]) -> list[float]:
    """megatron-core's ``utils.normalize`` (float64 division by the sum)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def _guess(w: np.ndarray, counts: np.ndarray, left: np.ndarray, n: int) -> np.ndarray:
    """`n` picks by the fixed priority ``(c_d + j) / w_d`` (ties to the lower corpus)."""
    per = np.minimum(np.ceil(w * n).astype(np.int64) + 2, left)
    keys = np.concatenate([(counts[d] + np.arange(per[d])) / w[d] for d in range(w.shape[0])])
    who = np.repeat(np.arange(w.shape[0]), per)
    return who[np.lexsort((who, keys))[:n]]


def _checked_prefix(
    w: np.ndarray, counts: np.ndarray, caps: np.ndarray | None, start: int, guess: np.ndarray
) -> np.ndarray:
    """The rule's picks for positions ``start..`` as far as `guess` agrees with it (one past: the pick
    at the first disagreement is the rule's, its state being right)."""
    eye = np.eye(w.shape[0], dtype=np.int64)
    before = counts + np.concatenate(
        [np.zeros((1, w.shape[0]), np.int64), np.cumsum(eye[guess[:-1]], axis=0)]
    )
    t = np.maximum(np.arange(start, start + guess.shape[0], dtype=np.float64), 1.0)
    err = w[None, :] * t[:, None] - before.astype(np.float64)
    if caps is not None:
        err[before >= caps[None, :]] = -np.inf
    picks = np.argmax(err, axis=1)
    bad = np.flatnonzero(picks != guess)
    return picks if bad.size == 0 else picks[: int(bad[0]) + 1]


def _loop(w: list[float], counts: list[int], caps: list[int] | None, start: int, n: int) -> list[int]:
    out = []
    for s in range(start, start + n):
        t = float(s) if s > 1 else 1.0
        best, best_err = -1, -np.inf
        for d, wd in enumerate(w):
            if caps is not None and counts[d] >= caps[d]:
                continue
            e = wd * t - counts[d]
            if e > best_err:
                best, best_err = d, e
        counts[best] += 1
        out.append(best)
    return out


def blending_indices(
    weights: Sequence[float], *, size: int, caps: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index int16, sample-within-dataset int64) for `size` blend positions.

    `weights` must be normalised (as megatron-core passes them); with `caps`, `size` is their sum.
    """
    w = np.asarray(weights, dtype=np.float64)
    n_sets = w.shape[0]
    cap = None if caps is None else np.asarray(caps, dtype=np.int64)
    counts = np.zeros(n_sets, dtype=np.int64)
    picks = np.empty(size, dtype=np.int64)
    s, chunk = 0, 1024
    while s < size:
        n = min(chunk, size - s)
        left = np.full(n_sets, n, dtype=np.int64) if cap is None else cap - counts
        got = _checked_prefix(w, counts, cap, s, _guess(w, counts, left, n))
        if got.shape[0] < n // 4:  # guesses fail often here: a plain loop for a stretch
            c = counts.tolist()
            got = np.asarray(
                _loop(w.tolist(), c, None if cap is None else cap.tolist(), s, min(4096, size - s)),
                dtype=np.int64,
            )
            chunk = 1024
        else:
            chunk = min(chunk * 2, 1 << 18) if got.shape[0] == n else chunk
        picks[s : s + got.shape[0]] = got
        counts += np.bincount(got, minlength=n_sets)
        s += got.shape[0]
    within = np.empty(size, dtype=np.int64)
    for d in range(n_sets):  # the c_d-th sample of corpus d: a running count per corpus
        mine = picks == d
        within[mine] = np.arange(int(mine.sum()))
    return picks.astype(np.int16), within


def size_per_dataset(weights: Sequence[float], *, size: int, surplus: float = 0.0) -> list[int]:
    """megatron-core's ``_get_size_per_split_per_dataset`` for one split: ``ceil(ceil(size * w) * (1 + surplus))``."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]
