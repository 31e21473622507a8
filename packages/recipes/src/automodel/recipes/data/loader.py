"""Datasets from the config: documents -> tokens -> packed rows -> per-step micro-batches."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from automodel.recipes.config.sections import SFTDatasetSection
from automodel.recipes.data.corpus import embedded_documents
from automodel.recipes.data.file_check import check_bad_rows_files, read_good_rows
from automodel.recipes.data.kinds import build_dataset, check_paths
from automodel.recipes.data.packing import PackedDataset, pack_documents
from automodel.recipes.data.sample_order import SequentialOrder
from automodel.recipes.data.sampler import StatefulGlobalBatchSampler
from automodel.recipes.data.sft import build_sft_dataset
from automodel.recipes.errors import ConfigError
from automodel.recipes.hub_cache import resolve_local_or_cached


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
        rows, skipped = read_good_rows(section, [Path(p) for p in paths])
        texts = [row.get(text_key) for row in rows]
        nulls = sum(t is None for t in texts)  # a row without its text: bad here, not a document
        if nulls:
            skipped["null_value"] += nulls
        _report_skipped(section, rows=len(rows) - nulls, skipped=skipped)
        return _documents(texts, max_bytes=section.max_bytes)
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
    return _documents(ds[text_key], max_bytes=section.max_bytes)


def _documents(texts: Any, *, max_bytes: int) -> list[str]:
    """The non-empty texts, in order, up to `max_bytes` characters."""
    docs, total = [], 0
    for text in texts:
        if isinstance(text, str) and text:
            docs.append(text)
            total += len(text)
            if total >= max_bytes:
                break
    return docs


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
        docs = embedded_documents(split=section.split, max_bytes=section.max_bytes)
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
) -> Any:
    """This rank's stateful loader: a stream's own (`streaming`), else a `BatchLoader` over the
    global sampler. ``next_step()``, ``state_dict()``, ``load_state_dict()``, ``steps_per_epoch``
    (None for a stream)."""
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
    return BatchLoader(dataset, sampler)


class BatchLoader:
    """Stateful per-step loader: `next_step()` -> this rank's micro-batches; checkpointable."""

    def __init__(self, dataset: PackedDataset, sampler: StatefulGlobalBatchSampler) -> None:
        self.dataset = dataset
        self.sampler = sampler

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def next_step(self) -> list[Batch]:
        return [Batch(*self.dataset.batch(ix)) for ix in self.sampler.next_step()]

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
