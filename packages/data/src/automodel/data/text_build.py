"""The text and SFT kinds' datasets: documents -> tokens -> packed rows (text), examples -> rows with
answer-only labels (SFT); and their pre-launch path checks."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch.distributed as dist

from automodel.data.corpus import embedded_documents
from automodel.data.errors import ConfigError, optional
from automodel.data.file_check import check_bad_rows_files
from automodel.data.hub_cache import resolve_local_or_cached
from automodel.data.packing import PackedDataset, pack_documents, packed_row_count
from automodel.data.quiet_datasets import no_progress_bars
from automodel.data.sft import build_sft_dataset, count_sft_rows
from automodel.data.text_rows import first_textless, read_texts_skipping
from automodel.data.text_sections import DatasetSection, SFTDatasetSection


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


def check_text_paths(section: DatasetSection) -> None:
    """Pretraining text: local json / text / parquet files."""
    if section.source == "embedded":
        return
    paths = section.path if isinstance(section.path, list) else [section.path]
    for p in paths:
        if not Path(p).exists():
            raise ConfigError(f"{section.SECTION}.path", p, "does not exist (only local files are read)")


def _local_documents(section: DatasetSection, *, report: bool) -> list[str]:
    datasets = optional("datasets", needed_for="json / text / parquet pretraining files")

    key = section.SECTION
    check_text_paths(section)
    paths = section.path if isinstance(section.path, list) else [section.path]
    builder = {"json": "json", "text": "text", "parquet": "parquet"}[section.source]
    text_key = "text" if builder == "text" else section.text_key
    if section.bad_rows == "skip":  # the good rows only (`datasets` rejects a file on one bad row)
        texts, skipped = read_texts_skipping(section, [Path(p) for p in paths])
        if report:
            _report_skipped(section, rows=len(texts), skipped=skipped)
        return _documents(section, texts, report=report)
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
    return _documents(section, texts, report=report)


def _documents(section: DatasetSection, texts: Any, *, report: bool) -> list[str]:
    """The non-empty texts, in order; with ``max_bytes`` set, whole documents up to that many
    characters, and (with `report`) rank 0 says how much of the text that left out."""
    docs = [t for t in texts if isinstance(t, str) and t]
    cap = section.max_bytes
    if cap is None:
        return docs
    kept, total = 0, 0
    while kept < len(docs) and total < cap:
        total += len(docs[kept])
        kept += 1
    if report and kept < len(docs) and not (dist.is_initialized() and dist.get_rank() != 0):
        print(max_bytes_line(section, docs=docs, kept=kept), file=sys.stderr, flush=True)
    return docs[:kept]


def max_bytes_line(section: DatasetSection, *, docs: list[str], kept: int) -> str:
    """The start-up line of a cut corpus: what ``max_bytes`` kept of the text given."""
    read = sum(len(d) for d in docs[:kept])
    return (
        f"{section.SECTION}: {section.SECTION}.max_bytes={section.max_bytes} read {read:,} of "
        f"{sum(len(d) for d in docs):,} characters ({kept} of {len(docs)} documents); "
        f"unset it to train on all of {section.SECTION}.path"
    )


def _report_skipped(section: DatasetSection, *, rows: int, skipped: Any) -> None:
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


def build_sft_rows(
    section: SFTDatasetSection, tokenizer: Any, *, packed_sequence_size: int, seed: int
) -> Any:
    """SFT examples: answer-only labels, one per row or whole examples packed (`SFTDataset`)."""
    return build_sft_dataset(section, tokenizer, packed_sequence_size=packed_sequence_size)


def count_sft_section_rows(
    section: SFTDatasetSection, tokenizer: Any, *, packed_sequence_size: int, seed: int, at_least: int
) -> int:
    """`build_sft_rows`'s rows, counted before launch (`sft.count_sft_rows`)."""
    return count_sft_rows(section, tokenizer, packed_sequence_size=packed_sequence_size, at_least=at_least)


def build_text_dataset(
    section: DatasetSection, tokenizer: Any, *, packed_sequence_size: int, seed: int
) -> PackedDataset:
    """Read the section's documents, tokenize, and pack into rows (document-aware when packed)."""
    docs = _section_documents(section, report=True)
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


def _section_documents(section: DatasetSection, *, report: bool) -> list[str]:
    """The section's documents: the built-in corpus (the first ``max_bytes`` characters of the
    stdlib split, 2,000,000 unset) or its local files."""
    if section.source == "embedded":
        cap = section.max_bytes
        return embedded_documents(split=section.split, **({} if cap is None else {"max_bytes": cap}))
    return _local_documents(section, report=report)


def count_text_rows(
    section: DatasetSection, tokenizer: Any, *, packed_sequence_size: int, seed: int, at_least: int
) -> int:
    """The rows `build_text_dataset` gives, or `at_least` once that many are certain, without
    building them: the same documents, tokenizer and row rule (`packing.packed_row_count`, each
    document followed by EOS as `pack_documents` joins them), ``max_rows`` applied; documents are
    tokenized only until `at_least` rows are filled (the cost of a pre-launch count)."""
    seq = packed_sequence_size if packed_sequence_size > 0 else section.seq_length
    want = at_least if section.max_rows is None else min(at_least, section.max_rows)
    with nullcontext() if section.source == "embedded" else no_progress_bars():  # read by `datasets`
        docs = _section_documents(section, report=False)
    tokens = 0
    for doc in docs:
        tokens += len(tokenizer.encode(doc)) + 1  # + the EOS after it
        if packed_row_count(tokens, seq_length=seq) >= want:
            return want
    rows = packed_row_count(tokens, seq_length=seq)
    return rows if section.max_rows is None else min(rows, section.max_rows)
