"""Local JSON-lines and text data files, read once before launch: a bad row is named by file and line.

Read by `datasets`/pyarrow inside every rank, a non-UTF-8 byte gave a 168-line traceback, a
malformed line named the file but not the line, three integer answers made pyarrow reject the
whole file, and an empty file surfaced as a ``global_batch_size`` problem. Here each is one
`DataError` naming the file, the line and what is wrong with it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from automodel.data.errors import ConfigError, DataError
from automodel.data.file_kind import os_error_line, unreadable_file
from automodel.data.sections import ExampleSection, RowsSection
from automodel.data.table_rows import (
    CSV_SUFFIXES,
    PARQUET_SUFFIXES,
    check_parquet_columns,
    read_csv_rows,
    read_parquet_rows,
    read_parquet_schema,
    read_text_lines,
)
from automodel.data.text_sections import DatasetSection, SFTDatasetSection

JSON_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt",)
SKIP_SUFFIXES = (*JSON_SUFFIXES, *CSV_SUFFIXES, *PARQUET_SUFFIXES)


#: Why a row was skipped under ``bad_rows: skip`` (the counted reasons; `table_rows` for CSV/Parquet).
REASONS = ("encoding", "malformed_json", "not_an_object", "wrong_type", "malformed_csv", "null_value")


class BadRow(DataError):
    """One bad row: `reason` is one of `REASONS`, the message names its file and line."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _rows(path: Path, limit: int | None) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed row or BadRow)`` of a JSON-lines file (or of a .json file holding one
    array, which is one document: a bad byte or bracket in it is fatal, never a skippable row)."""
    raw = path.read_bytes()
    if raw.lstrip()[:1] == b"[":  # one JSON array, not JSON lines
        text = _decode(path, raw, line_offset=0)
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
        yield from ((i + 1, row) for i, row in enumerate(rows[:limit] if limit else rows))
        return
    count = 0
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            text = _decode(path, line, line_offset=lineno)
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as e:
                yield (
                    lineno,
                    BadRow(
                        "malformed_json", f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})"
                    ),
                )
        except BadRow as bad:
            yield lineno, bad
        count += 1
        if limit is not None and count >= limit:
            return


def _decode(path: Path, data: bytes, *, line_offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line_offset or data[: e.start].count(b"\n") + 1
        where = f"{path}:{line}"
        raise BadRow(
            "encoding",
            f"{where}: not UTF-8 (byte 0x{data[e.start]:02x} at column {e.start + 1}); "
            "re-encode the file as UTF-8",
        ) from None


def _check_row(
    path: Path, lineno: int, row: Any, *, text_columns: tuple[str, ...], list_columns: tuple[str, ...]
) -> None:
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(
            "not_an_object", f"{path}:{lineno}: a row must be a JSON object, got {type(row).__name__}"
        )
    for column in text_columns:
        value = row.get(column)
        if value is not None and not isinstance(value, str):
            raise BadRow(
                "wrong_type",
                f"{path}:{lineno}: column {column!r} holds {type(value).__name__} {value!r:.40}, not text",
            )
    for column in list_columns:
        value = row.get(column)
        if value is not None and not isinstance(value, list):
            raise BadRow(
                "wrong_type",
                f"{path}:{lineno}: column {column!r} holds {type(value).__name__} {value!r:.40}, not a list",
            )


def read_json_rows(
    path: Path,
    *,
    text_columns: tuple[str, ...],
    list_columns: tuple[str, ...] = (),
    limit: int | None = None,
    skip: bool = False,
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """The good rows of `path` and, with `skip`, the bad ones counted per reason (`REASONS`);
    without it the first bad row raises `DataError` naming the file and line. An empty file raises."""
    good: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    for lineno, row in _rows(path, limit):
        try:
            _check_row(path, lineno, row, text_columns=text_columns, list_columns=list_columns)
        except BadRow as bad:
            if not skip:
                raise DataError(str(bad)) from None
            skipped[bad.reason] += 1
            continue
        good.append(row)
    if not good and not skipped:
        raise DataError(f"{path} holds no rows (an empty file)")
    return good, skipped


def check_json_rows(
    path: Path,
    *,
    text_columns: tuple[str, ...],
    list_columns: tuple[str, ...] = (),
    limit: int | None = None,
    skip: bool = False,
) -> int:
    """Every row of `path` is a JSON object whose `text_columns` (where present) hold text.

    Returns the number of good rows; raises `DataError` naming the file and line of the first bad
    one (with `skip`, bad rows are left for the reader to skip and count).
    """
    good, _ = read_json_rows(
        path, text_columns=text_columns, list_columns=list_columns, limit=limit, skip=skip
    )
    return len(good)


def check_bad_rows_files(section: SFTDatasetSection) -> None:
    """``bad_rows: skip`` reads the rows itself (`datasets` rejects a whole file on one bad row): the
    SFT section's local files must be JSON, CSV or Parquet (run before launch, with the path checks;
    the key's value and source are the section's own check, `config.sections.check_bad_rows_key`)."""
    if section.bad_rows != "skip":
        return
    paths = section.path_or_dataset_id
    names = [str(p) for p in (paths if isinstance(paths, list) else [paths]) if p is not None]
    other = [n for n in names if Path(n).expanduser().is_file() and not n.endswith(SKIP_SUFFIXES)]
    if other:
        raise ConfigError(
            f"{section.SECTION}.bad_rows",
            "skip",
            f"applies to {', '.join(SKIP_SUFFIXES)} files, not {other[0]}",
        )


def section_columns(section: RowsSection | ExampleSection) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(text columns, list columns) a section's JSON rows must hold where present."""
    if isinstance(section, DatasetSection):
        return ((section.text_key,) if section.source in ("json", "parquet") else ()), ()
    mapping = getattr(section, "column_mapping", None) or {}  # SFT (a hub section maps no column)
    if section.source == "instruction":
        return tuple(str(c) for c in mapping.values()), ()
    return (), (str(mapping.get("messages", "messages")),)


def check_text_file(path: Path) -> None:
    """A plain text file: UTF-8 and not empty."""
    raw = path.read_bytes()
    try:
        _decode(path, raw, line_offset=0)
    except BadRow as bad:
        raise DataError(str(bad)) from None
    if not raw.strip():
        raise DataError(f"{path} holds no text (an empty file)")


def check_text_rows(section: DatasetSection) -> None:
    """The text kind's rows before launch (`DatasetKind.check_rows`): its json / text / parquet
    files; the ``embedded`` source reads none."""
    if section.source == "embedded" or section.path is None:
        return
    paths = section.path if isinstance(section.path, list) else [section.path]
    _check_row_files(section, [Path(p) for p in paths], key=f"{section.SECTION}.path", limit=None)


def check_sft_rows(section: SFTDatasetSection) -> None:
    """The SFT kind's rows before launch (`DatasetKind.check_rows`): instruction and chat files;
    ``stdlib_docstrings`` builds its rows and reads none."""
    if section.source == "stdlib_docstrings":
        return
    src = section.path_or_dataset_id
    files = [Path(p).expanduser() for p in (src if isinstance(src, list) else [src])]
    key = f"{section.SECTION}.{section.PATH_KEY}"
    _check_row_files(section, files, key=key, limit=section.limit_dataset_samples, folders=True)


def _check_row_files(
    section: RowsSection, files: list[Path], *, key: str, limit: int | None, folders: bool = False
) -> None:
    """Every bad row a local file holds, as the run would meet it (`key`: the section's path key).

    A file that cannot be read (`file_kind.unreadable_file`: permissions, a FIFO, a dangling link;
    a directory unless `folders`, where `datasets` reads a dataset folder) is refused by name."""
    source = section.source
    skip = section.bad_rows == "skip"
    text_columns, list_columns = section_columns(section)
    list_columns = list_columns if skip else ()  # `error`: a non-list is the encoder's counted skip
    for f in files:
        if folders and f.is_dir() or not (f.exists() or f.is_symlink()):
            continue  # a dataset folder or a Hub id: read by `datasets` itself
        problem = unreadable_file(f)
        if problem is not None:
            raise ConfigError(key, str(f), problem)
        try:
            _check_one_file(
                f, source=source, skip=skip, key=key, limit=limit, columns=(text_columns, list_columns)
            )
        except OSError as e:  # read after the check above (a file that changed, an I/O error)
            raise ConfigError(key, str(f), f"cannot be read ({os_error_line(e)})") from None


def _check_one_file(
    f: Path, *, source: str, skip: bool, key: str, limit: int | None, columns: tuple[tuple[str, ...], ...]
) -> None:
    text_columns, list_columns = columns
    if source == "parquet" or f.suffix in PARQUET_SUFFIXES:
        # a column's type is the whole file's: a wrong one is refused before launch in both modes
        # (read by `datasets`, an int column made every row a skipped one: "the dataset has 0 rows")
        schema = read_parquet_schema(f, key=key)
        check_parquet_columns(
            f, schema, text_columns=text_columns, list_columns=list_columns, key=key, strict=not skip
        )
    elif f.suffix in CSV_SUFFIXES and not skip:  # the same strict reader the run uses
        read_csv_rows(f, columns=text_columns, key=key, strict=True)
    elif f.suffix in JSON_SUFFIXES:
        check_json_rows(f, text_columns=text_columns, list_columns=list_columns, limit=limit, skip=skip)
    elif (f.suffix in TEXT_SUFFIXES or source == "text") and not skip:
        check_text_file(f)


def read_good_rows(
    section: RowsSection | ExampleSection, files: list[Path]
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """``bad_rows: skip``: the good rows of the section's files, in order, with every row's
    columns (missing ones None), and the bad ones counted per reason. `datasets` rejects a whole
    file on one bad row, so the good rows are read here instead (JSON here, the rest `table_rows`)."""
    text_columns, list_columns = section_columns(section)
    sft = hasattr(section, "path_or_dataset_id")
    key = f"{section.SECTION}.{'path_or_dataset_id' if sft else 'path'}"
    rows: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    for f in files:
        kind = f.suffix.lower() if sft else f".{section.source}"
        if kind in (".text",):
            good, bad = read_text_lines(f, column="text")
        elif kind in (".parquet",):
            good, bad = read_parquet_rows(f, text_columns=text_columns, list_columns=list_columns, key=key)
        elif kind in CSV_SUFFIXES:
            good, bad = read_csv_rows(f, columns=text_columns + list_columns, key=key)
        elif kind in (*JSON_SUFFIXES, ".json"):
            good, bad = read_json_rows(f, text_columns=text_columns, list_columns=list_columns, skip=True)
        else:
            raise ConfigError(
                key, str(f), f"bad_rows: skip reads {', '.join(SKIP_SUFFIXES)} files, not this one"
            )
        rows += good
        skipped += bad
    if not rows:
        why = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items()))
        raise DataError(f"{', '.join(map(str, files))} holds no good rows (skipped {why})")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return [{c: row.get(c) for c in columns} for row in rows], skipped
