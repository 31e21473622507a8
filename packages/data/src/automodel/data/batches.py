"""Micro-batches for a training loop: `Batch`, the global sampler over a dataset, and the stateful
per-rank `BatchLoader` whose `state_dict()` is the position in the global sample sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from automodel.data.sample_order import SampleOrder, SequentialOrder
from automodel.data.sampler import StatefulGlobalBatchSampler
from automodel.data.token_ids import check_batch_ids


@dataclass
class Batch:
    """One micro-batch: token ids, next-token labels (-100 carries no loss) and position ids."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor


class RowDataset(Protocol):
    """What every dataset with a length answers (Megatron, blends, nanoGPT, text, SFT rows)."""

    def __len__(self) -> int: ...

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def build_sampler(
    dataset: RowDataset,
    *,
    global_batch_size: int,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    shuffle: bool = True,
) -> StatefulGlobalBatchSampler:
    """The training sampler over `dataset`, in the dataset's own `sample_order` when it has one;
    without `shuffle` (``dataloader.shuffle: false``), in the dataset's row order."""
    order: SampleOrder | None = getattr(dataset, "sample_order", None)
    return StatefulGlobalBatchSampler(
        num_rows=len(dataset),
        global_batch_size=global_batch_size,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        order=order if shuffle else SequentialOrder(len(dataset)),
    )


def read_batch(dataset: RowDataset, indices: list[int], *, vocab_size: int | None = None) -> Batch:
    """The micro-batch of `indices`; with `vocab_size`, an id the model cannot embed is a
    `token_ids.TokenIdError` naming its file and token (one max() over the batch)."""
    batch = Batch(*dataset.batch(indices))
    if vocab_size is not None:
        check_batch_ids(dataset, indices, batch.input_ids, batch.labels, vocab_size=vocab_size)
    return batch


class BatchLoader:
    """Stateful per-step loader: `next_step()` -> this rank's micro-batches; checkpointable.

    The state is the global position (epoch, step in epoch), the same on every dp rank: a loader
    built for another dp size (same global batch size) and given it continues the same global
    sample sequence."""

    def __init__(
        self, dataset: RowDataset, sampler: StatefulGlobalBatchSampler, *, vocab_size: int | None = None
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.vocab_size = vocab_size

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def next_step(self) -> list[Batch]:
        return [read_batch(self.dataset, ix, vocab_size=self.vocab_size) for ix in self.sampler.next_step()]

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
