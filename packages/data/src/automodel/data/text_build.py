"""Datasets from the config: documents -> tokens -> packed rows -> per-step micro-batches."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from automodel.recipes.config.sections import SFTDatasetSection
from automodel.data.corpus import embedded_documents
from automodel.data.file_check import check_bad_rows_files
from automodel.recipes.data.kinds import build_dataset, check_paths
from automodel.data.packing import PackedDataset, pack_documents
from automodel.data.sample_order import SequentialOrder
from automodel.data.sampler import StatefulGlobalBatchSampler
from automodel.recipes.data.sft import build_sft_dataset
from automodel.recipes.data.text_rows import first_textless, read_texts_skipping
from automodel.data.token_ids import check_batch_ids
from automodel.recipes.errors import ConfigError
from automodel.data.hub_cache import resolve_local_or_cached


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor


def check_data_paths(section: Any) -> None:
    """The section's data files must exist and open (checked before any rank starts; `validate`
    skips this). Each dataset kind has its own check (`kinds`)."""
    check_paths(section)


def check_sft_paths(section: SFTDatasetSection) -> None:
    """SFT: local files, or a Hub id resolved through the local cache; ``bad_rows: skip`` on files it
    can read row by row."""
    if section.source == "stdlib_docstrings":
        return
    check_bad_rows_files(section)
    src = section.path_or_dataset_id
    for p in src if isinstance(src, list) else []:
        if not Path(p).expanduser().is_file():
            raise ConfigError(
                f"{section.SECTION}.path_or_dataset_id", p, "does not exist (only local files are read)"
            )
    if isinstance(src, str) and not Path(src).expanduser().exists():
        resolve_local_or_cached(src, key=f"{section.SECTION}.path_or_dataset_id", repo_type="dataset")


def check_text_paths(section: Any) -> None:
    """Pretraining text: local json / text / parquet files."""
    if section.source == "embedded":
        return
    paths = section.path if isinstance(section.path, list) else [section.path]
    for p in paths:
        if not Path(p).exists():
            raise ConfigError(f"{section.SECTION}.path", p, "does not exist (only local files are read)")


def _local_documents(section: Any) -> list[str]:
    # lazy: start-up, datasets ~0.6 s, only where data is read
    import datasets

    key = section.SECTION
    check_text_paths(section)
    paths = section.path if isinstance(section.path, list) else [section.path]
    builder = {"json": "json", "text": "text", "parquet": "parquet"}[section.source]
    text_key = "text" if builder == "text" else section.text_key
    if section.bad_rows == "skip":  # the good rows only (`datasets` rejects a file on one bad row)
        texts, skipped = read_texts_skipping(section, [Path(p) for p in paths])
        _report_skipped(section, rows=len(texts), skipped=skipped)
        return _documents(section, texts)
    try:
        ds = datasets.load_dataset(builder, data_files=[str(p) for p in paths], split="train")
    except Exception as e:  # noqa: BLE001 - a file datasets cannot read is a config problem
        raise ConfigError(
            f"{key}.path", section.path, f"cannot be read as {builder} ({type(e).__name__})"
        ) from None
    if text_key not in ds.column_names:
        raise ConfigError(
            f"{key}.text_key", text_key, f"is not a column; columns: {', '.join(ds.column_names)}"
        )
    texts = ds[text_key]
    if any(t is None for t in texts):  # a row without its text (`datasets` reads it as null)
        raise first_textless(section)
    return _documents(section, texts)


def _documents(section: Any, texts: Any) -> list[str]:
    """The non-empty texts, in order; with ``max_bytes`` set, whole documents up to that many
    characters, and rank 0 says how much of the text that left out."""
    docs = [t for t in texts if isinstance(t, str) and t]
    cap = section.max_bytes
    if cap is None:
        return docs
    kept, total = 0, 0
    while kept < len(docs) and total < cap:
        total += len(docs[kept])
        kept += 1
    if kept < len(docs) and not (dist.is_initialized() and dist.get_rank() != 0):
        print(max_bytes_line(section, docs=docs, kept=kept), file=sys.stderr, flush=True)
    return docs[:kept]


def max_bytes_line(section: Any, *, docs: list[str], kept: int) -> str:
    """The start-up line of a cut corpus: what ``max_bytes`` kept of the text given."""
    read = sum(len(d) for d in docs[:kept])
    return (
        f"{section.SECTION}: {section.SECTION}.max_bytes={section.max_bytes} read {read:,} of "
        f"{sum(len(d) for d in docs):,} characters ({kept} of {len(docs)} documents); "
        f"unset it to train on all of {section.SECTION}.path"
    )


def _report_skipped(section: Any, *, rows: int, skipped: Any) -> None:
    """Rank 0: how many rows were read and how many bad ones were skipped, and why."""
    if not skipped or (dist.is_initialized() and dist.get_rank() != 0):
        return
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
    total = rows + sum(skipped.values())
    print(
        f"{section.SECTION}: {rows} rows read; skipped {sum(skipped.values())} of {total} ({why})",
        file=sys.stderr,
        flush=True,
    )


def build_packed_dataset(section: Any, tokenizer: Any, *, packed_sequence_size: int, seed: int = 0) -> Any:
    """The section's dataset (``len`` and ``batch(indices)``), built by its kind (`kinds`)."""
    return build_dataset(section, tokenizer, packed_sequence_size=packed_sequence_size, seed=seed)


def build_sft_rows(section: Any, tokenizer: Any, *, packed_sequence_size: int, seed: int) -> Any:
    """SFT examples: answer-only labels, one per row or whole examples packed (`SFTDataset`)."""
    return build_sft_dataset(section, tokenizer, packed_sequence_size=packed_sequence_size)


def build_text_dataset(
    section: Any, tokenizer: Any, *, packed_sequence_size: int, seed: int
) -> PackedDataset:
    """Read the section's documents, tokenize, and pack into rows (document-aware when packed)."""
    if section.source == "embedded":
        # the built-in corpus: the first max_bytes characters of the stdlib split (2,000,000 unset)
        cap = section.max_bytes
        docs = embedded_documents(split=section.split, **({} if cap is None else {"max_bytes": cap}))
    else:
        docs = _local_documents(section)
    tokens = pack_documents((tokenizer.encode(d) for d in docs), eos_token_id=tokenizer.eos_token_id)
    seq = packed_sequence_size if packed_sequence_size > 0 else section.seq_length
    ds = PackedDataset(
        tokens,
        seq_length=seq,
        eos_token_id=tokenizer.eos_token_id,
        document_boundaries=packed_sequence_size > 0,
    )
    if section.max_rows is not None and len(ds) > section.max_rows:
        if not (dist.is_initialized() and dist.get_rank() != 0):
            print(
                f"{section.SECTION}: {section.SECTION}.max_rows={section.max_rows} keeps "
                f"{section.max_rows} of {len(ds)} rows",
                file=sys.stderr,
                flush=True,
            )
        ds.rows = ds.rows[: section.max_rows]
    return ds


def build_sampler(
    dataset: Any,
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
    return StatefulGlobalBatchSampler(
        num_rows=len(dataset),
        global_batch_size=global_batch_size,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        order=getattr(dataset, "sample_order", None) if shuffle else SequentialOrder(len(dataset)),
    )


def build_train_loader(
    dataset: Any,
    *,
    global_batch_size: int,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    shuffle: bool = True,
    vocab_size: int | None = None,
) -> Any:
    """This rank's stateful loader: a stream's own (`streaming`), else a `BatchLoader` over the
    global sampler. ``next_step()``, ``state_dict()``, ``load_state_dict()``, ``steps_per_epoch``
    (None for a stream). With `vocab_size`, each batch's ids are checked against it."""
    if hasattr(dataset, "loader"):
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


def read_batch(dataset: Any, indices: list[int], *, vocab_size: int | None = None) -> Batch:
    """The micro-batch of `indices`; with `vocab_size`, an id the model cannot embed is a
    `token_ids.TokenIdError` naming its file and token (one max() over the batch)."""
    batch = Batch(*dataset.batch(indices))
    if vocab_size is not None:
        check_batch_ids(dataset, indices, batch.input_ids, batch.labels, vocab_size=vocab_size)
    return batch


class BatchLoader:
    """Stateful per-step loader: `next_step()` -> this rank's micro-batches; checkpointable."""

    def __init__(
        self, dataset: PackedDataset, sampler: StatefulGlobalBatchSampler, *, vocab_size: int | None = None
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
