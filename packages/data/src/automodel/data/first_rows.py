"""The first N rows of a dataset: ``packed_sequence.max_packs`` (AutoModel's cap on packed rows)."""

from __future__ import annotations

from typing import Any


class FirstRows:
    """A view of `dataset`'s first `n` rows (``len`` and ``batch(indices)``; other attributes pass through)."""

    def __init__(self, dataset: Any, n: int) -> None:
        self.dataset, self.n = dataset, min(n, len(dataset))

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: list[int]) -> Any:
        if any(not 0 <= i < self.n for i in indices):
            raise IndexError(f"row index out of range 0..{self.n - 1}: {indices}")
        return self.dataset.batch(indices)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataset, name)


def first_rows(dataset: Any, n: int | None) -> Any:
    """`dataset` itself when `n` is None, else its first `n` rows."""
    return dataset if n is None else FirstRows(dataset, n)
