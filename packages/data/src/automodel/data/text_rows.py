"""Pretraining rows without their text: an error naming the file and line, or counted by reason.

`datasets` reads a JSON row that lacks the text key as a null, and a null is no document: such a
row was dropped without a word under ``bad_rows: error`` and counted as ``null_value`` under
``skip``. Here a row whose text key is absent is ``missing_key``, one whose value is null is
``null_value``; under ``error`` the first of either stops the run naming its file and line (before
launch, and in the ranks should the files change in between).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from automodel.data.errors import DataError, optional
from automodel.data.file_check import read_good_rows, read_json_rows
from automodel.data.sections import DataSection
from automodel.data.text_sections import DatasetSection

#: The reasons a pretraining row holds no text (counted under ``bad_rows: skip``).
MISSING_KEY = "missing_key"
NULL_VALUE = "null_value"


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line, parsed row)`` of a JSON-lines file or a JSON array file (row number as line);
    rows that do not parse are the row check's (`file_check`), not this one's: left out here."""
    raw = path.read_bytes()
    if raw.lstrip()[:1] == b"[":
        try:
            rows = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return
        yield from enumerate(rows if isinstance(rows, list) else [], start=1)
        return
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if line.strip():
            try:
                yield lineno, json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue


def _why(row: dict[str, Any], key: str) -> str | None:
    if key not in row:
        return MISSING_KEY
    return NULL_VALUE if row[key] is None else None


def textless_rows(path: Path, *, key: str, source: str) -> Iterator[tuple[int, str]]:
    """``(line or row number, reason)`` of each row of `path` without text under `key`."""
    if source == "parquet":
        pq = optional("pyarrow.parquet", needed_for="Parquet rows")
        if key not in pq.read_schema(path).names:
            return  # a column the file lacks: `datasets` / `table_rows` name it
        column = pq.read_table(path, columns=[key]).column(key)
        for i, value in enumerate(column.is_null().to_pylist(), start=1):
            if value:
                yield i, NULL_VALUE
        return
    for lineno, row in _json_rows(path):
        if isinstance(row, dict) and (why := _why(row, key)) is not None:
            yield lineno, why


def _row_files(section: DatasetSection) -> list[Path]:
    paths = section.path if isinstance(section.path, list) else [section.path]
    return [Path(p).expanduser() for p in paths if p is not None]


def _reads_keys(section: DatasetSection) -> bool:
    """Only json and parquet rows have a text key (a text file's lines are the documents)."""
    return section.source in ("json", "parquet")


def textless_error(path: Path, line: int, why: str, *, section: DatasetSection) -> DataError:
    what = f"has no {section.text_key!r} key" if why == MISSING_KEY else f"has null {section.text_key!r}"
    return DataError(
        f"{path}:{line}: the row {what} ({section.SECTION}.text_key); under "
        f"{section.SECTION}.bad_rows: skip such rows are left out and counted as {why}"
    )


def check_text_keys(section: DataSection | None) -> None:
    """Before launch, ``bad_rows: error``: the first json / parquet row without its text, by file
    and line (``skip`` counts them in the ranks)."""
    if not isinstance(section, DatasetSection) or section.source == "embedded":
        return
    if not _reads_keys(section) or section.bad_rows == "skip":
        return
    for f in _row_files(section):
        if f.is_file():
            for line, why in textless_rows(f, key=section.text_key, source=section.source):
                raise textless_error(f, line, why, section=section)


def first_textless(section: DatasetSection) -> DataError:
    """In a rank, `datasets` gave a null text under ``bad_rows: error``: the error naming its row."""
    for f in _row_files(section):
        if f.is_file():
            for line, why in textless_rows(f, key=section.text_key, source=section.source):
                return textless_error(f, line, why, section=section)
    return DataError(
        f"{section.SECTION}.path={section.path!r}: a row has no text under {section.text_key!r} "
        f"({section.SECTION}.bad_rows: error)"
    )


def read_texts_skipping(section: DatasetSection, files: list[Path]) -> tuple[list[Any], Counter[str]]:
    """``bad_rows: skip``: every good row's text (None where it has none) and the bad rows counted
    per reason, rows without text among them (`MISSING_KEY`, `NULL_VALUE`)."""
    key = "text" if section.source == "text" else section.text_key
    if section.source != "json":
        rows, skipped = read_good_rows(section, files)
        texts = [row.get(key) for row in rows]
        if nulls := sum(t is None for t in texts):  # a null cell (parquet): the column is there
            skipped[NULL_VALUE] += nulls
        texts = [t for t in texts if t is not None]
    else:  # JSON rows as parsed, so an absent key is told from a null value
        texts, skipped = [], Counter()
        for f in files:
            good, bad = read_json_rows(f, text_columns=(key,), skip=True)
            skipped += bad
            for row in good:
                why = _why(row, key)
                if why is None:
                    texts.append(row[key])
                else:
                    skipped[why] += 1
    if not texts:
        why = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items()))
        raise DataError(f"{', '.join(map(str, files))} holds no good rows (skipped {why})")
    return texts, skipped
