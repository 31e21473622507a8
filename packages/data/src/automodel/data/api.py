"""The entry points for a plain torch training loop: a dataset from a typed section, and this dp
rank's stateful loader over it.

    section = MegatronPretrainingSection(paths="corpus/demo", seq_length=512, split="100,0,0", seed=1)
    dataset = build_dataset(section, tokenizer=Vocab(vocab_size=32000, eos_token_id=2))
    loader = build_loader(dataset, global_batch_size=64, local_batch_size=4, dp_rank=r, dp_size=n, seed=1)
    for batch in loader.next_step(): ...      # this rank's micro-batches of one optimizer step
    state = loader.state_dict()               # the global position: the same on every rank

A loader built for another dp size (same ``global_batch_size``) that loads `state` continues the same
global sample sequence: Megatron corpora, blends and nanoGPT shards. A streaming loader's position is
its dp rank's share of the files, so it refuses another dp size (a `ConfigError` naming
``dataset.source``); preprocess such a corpus (`automodel.data.preprocess`) to resume anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from automodel.data.batches import BatchLoader, RowDataset, build_sampler
from automodel.data.errors import ConfigError
from automodel.data.pretrain_build import build_megatron, build_nanogpt
from automodel.data.pretrain_sections import MegatronPretrainingSection, NanogptSection
from automodel.data.sections import DataSection
from automodel.data.streaming import StreamingDataset, StreamingLoader, build_streaming
from automodel.data.streaming_section import StreamingSection
from automodel.data.text_build import build_sft_rows, build_text_dataset
from automodel.data.text_sections import DatasetSection, SFTDatasetSection


class Vocabulary(Protocol):
    """What the pre-tokenised kinds read of a tokenizer: the ids a shard must hold and the EOS."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...


@dataclass(frozen=True)
class Vocab:
    """A tokenizer's sizes alone, for corpora that are already token ids (Megatron, nanoGPT)."""

    vocab_size: int
    eos_token_id: int

    def __post_init__(self) -> None:
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ConfigError("vocab_size", self.vocab_size, "must be an int >= 1")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ConfigError(
                "eos_token_id", self.eos_token_id, f"must be an id below vocab_size={self.vocab_size}"
            )


def build_dataset(
    section: DataSection, *, tokenizer: Vocabulary, packed_sequence_size: int = 0, seed: int = 0
) -> RowDataset | StreamingDataset:
    """The section's dataset. ``packed_sequence_size > 0``: rows of that length whose positions
    restart after each EOS. `seed` is the run's (a Megatron section's own ``seed`` wins). The text,
    streaming and SFT kinds encode text: `tokenizer` is then a `tokenizer.ByteTokenizer` or
    `tokenizer.HFTokenizer` (`tokenizer.build_tokenizer`); the pre-tokenised kinds read only its
    sizes (`Vocab`)."""
    if isinstance(section, MegatronPretrainingSection):
        return build_megatron(section, tokenizer, packed_sequence_size=packed_sequence_size, seed=seed)
    if isinstance(section, NanogptSection):
        return build_nanogpt(section, tokenizer, packed_sequence_size=packed_sequence_size, seed=seed)
    if isinstance(section, StreamingSection):
        return build_streaming(section, tokenizer, packed_sequence_size=packed_sequence_size, seed=seed)
    if isinstance(section, DatasetSection):
        return build_text_dataset(section, tokenizer, packed_sequence_size=packed_sequence_size, seed=seed)
    if isinstance(section, SFTDatasetSection):
        return build_sft_rows(section, tokenizer, packed_sequence_size=packed_sequence_size, seed=seed)
    raise TypeError(f"{type(section).__name__} is not a section automodel.data builds")


def build_loader(
    dataset: RowDataset | StreamingDataset,
    *,
    global_batch_size: int,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    shuffle: bool = True,
    vocab_size: int | None = None,
) -> BatchLoader | StreamingLoader:
    """This dp rank's stateful loader: ``next_step()`` (its micro-batches of the next global batch),
    ``state_dict()`` / ``load_state_dict()``, ``steps_per_epoch`` (None for a stream). With
    `vocab_size`, each batch's ids are checked against it (a `TokenIdError` naming file and token)."""
    if isinstance(dataset, StreamingDataset):
        return dataset.loader(
            global_batch_size=global_batch_size,
            local_batch_size=local_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )
    sampler = build_sampler(
        dataset,
        global_batch_size=global_batch_size,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=shuffle,
    )
    return BatchLoader(dataset, sampler, vocab_size=vocab_size)
