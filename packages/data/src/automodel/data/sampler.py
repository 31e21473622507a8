"""A stateful, rank-aware sampler over global batches.

Each optimizer step consumes one global batch of ``global_batch_size`` rows from a seeded
permutation of the dataset (reshuffled per epoch). The dp rank ``r`` of ``dp`` takes the r-th
contiguous slice and splits it into micro-batches of ``local_batch_size``; CP/TP/PP ranks of the
same replica share the dp rank and so see the same rows. Because the global batch does not depend
on dp or on accumulation, every layout trains on the same data. `state_dict()` is the position.

The order is `order.indices(epoch=, start=, stop=)` when given (the orders of `sample_order`,
computed per index for corpora too large to permute in memory), else a ``torch.randperm`` per epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def check_rows_fill_batch(*, num_rows: int, global_batch_size: int) -> None:
    """A training set holds at least one global batch of rows (a step never repeats a row).

    The one home of this rule: the sampler checks it in every rank, and the `recipes` launcher
    checks the same rule on the rows it counts before any rank starts (`count_rows` of the kind)."""
    if num_rows < global_batch_size:
        raise ValueError(f"the dataset has {num_rows} rows, fewer than global_batch_size={global_batch_size}")


def check_position_rows(state: Mapping[str, Any], *, num_rows: int) -> None:
    """A saved position (`StatefulGlobalBatchSampler.state_dict`) is one in a dataset of `num_rows`."""
    if state.get("num_rows", num_rows) != num_rows:
        raise ValueError(f"sampler state is for {state['num_rows']} rows, this dataset has {num_rows}")


def check_position_batch(state: Mapping[str, Any], *, global_batch_size: int) -> None:
    """A saved position counts global batches of `global_batch_size`: under another size the same
    count names other samples (a state saved before the size was recorded carries no check). The
    one home of this rule: the ranks' resume and the `recipes` launcher's (`row_counts`)."""
    if state.get("global_batch_size", global_batch_size) != global_batch_size:
        raise ValueError(
            f"sampler state is for global_batch_size={state['global_batch_size']}, this loader's is "
            f"{global_batch_size}: the same position would name other samples"
        )


class StatefulGlobalBatchSampler:
    """Yields, per step, this dp rank's micro-batches of row indices."""

    def __init__(
        self,
        *,
        num_rows: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        order: Any = None,
    ) -> None:
        if global_batch_size % (local_batch_size * dp_size) != 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} must be a multiple of local_batch_size*dp = "
                f"{local_batch_size}*{dp_size}"
            )
        check_rows_fill_batch(num_rows=num_rows, global_batch_size=global_batch_size)
        assert 0 <= dp_rank < dp_size
        self.num_rows = num_rows
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.order = order
        self.epoch = 0
        self.batch_in_epoch = 0

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.global_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.local_batch_size * self.dp_size)

    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + 7919 * epoch)
        return torch.randperm(self.num_rows, generator=g)

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches for the next optimizer step (advances the state)."""
        if self.batch_in_epoch >= self.steps_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
        start = self.batch_in_epoch * self.global_batch_size
        per_rank = self.global_batch_size // self.dp_size
        first = start + self.dp_rank * per_rank
        if self.order is not None:
            mine = self.order.indices(epoch=self.epoch, start=first, stop=first + per_rank)
        else:
            mine = self._permutation(self.epoch)[first : first + per_rank].tolist()
        self.batch_in_epoch += 1
        lb = self.local_batch_size
        return [mine[i : i + lb] for i in range(0, per_rank, lb)]

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "num_rows": self.num_rows,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        check_position_rows(state, num_rows=self.num_rows)
        check_position_batch(state, global_batch_size=self.global_batch_size)
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self.seed = int(state.get("seed", self.seed))
