"""Datasets from the config: documents -> tokens -> packed rows -> per-step micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from automodel.recipes.data.corpus import embedded_documents
from automodel.recipes.data.packing import PackedDataset, pack_documents
from automodel.recipes.data.sampler import StatefulGlobalBatchSampler
from automodel.recipes.errors import ConfigError


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor


def check_data_paths(section: Any) -> None:
    """Local data files must exist (checked before any rank starts; `validate` skips this)."""
    if section is None or section.source in ("embedded", "stdlib_docstrings"):
        return
    if hasattr(section, "path_or_dataset_id"):  # SFT: local files, or a Hub id resolved when read
        src = section.path_or_dataset_id
        for p in src if isinstance(src, list) else []:
            if not Path(p).expanduser().is_file():
                raise ConfigError(
                    f"{section.SECTION}.path_or_dataset_id", p, "does not exist (only local files are read)"
                )
        if isinstance(src, str) and not Path(src).expanduser().exists():
            from automodel.recipes.hub_cache import resolve_local_or_cached

            resolve_local_or_cached(src, key=f"{section.SECTION}.path_or_dataset_id", repo_type="dataset")
        return
    paths = section.path if isinstance(section.path, list) else [section.path]
    for p in paths:
        if not Path(p).exists():
            raise ConfigError(f"{section.SECTION}.path", p, "does not exist (only local files are read)")


def _local_documents(section: Any) -> list[str]:
    import datasets

    key = section.SECTION
    check_data_paths(section)
    paths = section.path if isinstance(section.path, list) else [section.path]
    builder = {"json": "json", "text": "text", "parquet": "parquet"}[section.source]
    try:
        ds = datasets.load_dataset(builder, data_files=[str(p) for p in paths], split="train")
    except Exception as e:  # noqa: BLE001 - a file datasets cannot read is a config problem
        raise ConfigError(
            f"{key}.path", section.path, f"cannot be read as {builder} ({type(e).__name__})"
        ) from None
    text_key = "text" if builder == "text" else section.text_key
    if text_key not in ds.column_names:
        raise ConfigError(
            f"{key}.text_key", text_key, f"is not a column; columns: {', '.join(ds.column_names)}"
        )
    docs, total = [], 0
    for text in ds[text_key]:
        if isinstance(text, str) and text:
            docs.append(text)
            total += len(text)
            if total >= section.max_bytes:
                break
    return docs


def build_packed_dataset(section: Any, tokenizer: Any, *, packed_sequence_size: int) -> Any:
    """Read the section's documents, tokenize, and pack into rows (document-aware when packed).

    An SFT section (`SFTDatasetSection`) gives an `SFTDataset` (answer-only labels, one example
    per row or whole examples packed); both have ``len`` and ``batch(indices)``.
    """
    if hasattr(section, "path_or_dataset_id"):
        from automodel.recipes.data.sft import build_sft_dataset

        return build_sft_dataset(section, tokenizer, packed_sequence_size=packed_sequence_size)
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


class BatchLoader:
    """Stateful per-step loader: `next_step()` -> this rank's micro-batches; checkpointable."""

    def __init__(self, dataset: PackedDataset, sampler: StatefulGlobalBatchSampler) -> None:
        self.dataset = dataset
        self.sampler = sampler

    def next_step(self) -> list[Batch]:
        return [Batch(*self.dataset.batch(ix)) for ix in self.sampler.next_step()]

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
