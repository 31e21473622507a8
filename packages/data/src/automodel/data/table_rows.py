"""``bad_rows: skip`` for CSV, Parquet and plain-text files: the good rows, the bad ones counted.

`datasets` reads these files whole, so one bad row fails the file. Read here row by row instead:

- CSV: a row that is not UTF-8 (``encoding``) or whose field count differs from the header's
  (``malformed_csv``) is left out. Every CSV value is text, so a wrong type cannot occur; an empty
  field is None. ``bad_rows: error`` reads CSV here too (``strict``: the first bad row is a
  `DataError` naming file and line), so a file reads the same in both modes (pandas, behind
  `datasets`, would turn a column of digits into integers and "NA" into a null).
- Parquet: a column's type holds for the whole file, so a column of the wrong type (or a missing
  column) is not a row to leave out: it is refused as a `ConfigError` naming the file and column.
  Null values are rows (counted by the caller where a value is required).
- Plain text (one document per line): a line that is not UTF-8 (``encoding``) is left out.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from pathlib import Path
from typing import Any

from automodel.data.errors import ConfigError, DataError, optional

CSV_SUFFIXES = (".csv",)
PARQUET_SUFFIXES = (".parquet",)

Rows = tuple[list[dict[str, Any]], Counter[str]]


def _not_utf8(text: str) -> bool:
    """True when `text` holds a byte that was not UTF-8 (decoded with ``surrogateescape``)."""
    return any("\udc80" <= ch <= "\udcff" for ch in text)


def _require_columns(
    path: Path, found: list[str], needed: tuple[str, ...], *, key: str, strict: bool = False
) -> None:
    missing = [c for c in needed if c not in found]
    if missing:
        why = "" if strict else "; bad_rows: skip leaves out rows, not a column a whole file lacks"
        raise ConfigError(
            key, str(path), f"has no column {missing[0]!r} (its columns: {', '.join(found)}){why}"
        )


def read_csv_rows(path: Path, *, columns: tuple[str, ...], key: str, strict: bool = False) -> Rows:
    """The rows of a CSV file with a header line, and the bad ones counted (module docstring);
    `strict` raises `DataError` naming the file and line at the first bad row instead."""
    text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if header is None or _not_utf8("".join(header)):
        raise ConfigError(key, str(path), "has no UTF-8 header line (CSV files need one naming the columns)")
    _require_columns(path, header, columns, key=key, strict=strict)
    rows: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    while True:
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as e:  # e.g. a NUL byte: the rest of this record cannot be parsed
            if strict:
                raise DataError(f"{path}:{reader.line_num}: not a CSV record ({e})") from None
            skipped["malformed_csv"] += 1
            continue
        if not record:
            continue  # a blank line
        if len(record) != len(header):
            if strict:
                raise DataError(
                    f"{path}:{reader.line_num}: {len(record)} fields where the header has {len(header)}"
                )
            skipped["malformed_csv"] += 1
        elif any(_not_utf8(v) for v in record):
            if strict:
                raise DataError(f"{path}:{reader.line_num}: not UTF-8")
            skipped["encoding"] += 1
        else:
            rows.append({c: (v if v != "" else None) for c, v in zip(header, record, strict=True)})
    return rows, skipped


def _parquet() -> Any:
    return optional("pyarrow.parquet", needed_for="Parquet rows")


def _is_text(t: Any) -> bool:
    pa = optional("pyarrow", needed_for="Parquet rows")
    return (
        pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t) or str(t) == "string_view"
    )


def _is_list(t: Any) -> bool:
    pa = optional("pyarrow", needed_for="Parquet rows")
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_null(t)


def check_parquet_columns(
    path: Path,
    schema: Any,
    *,
    text_columns: tuple[str, ...],
    list_columns: tuple[str, ...],
    key: str,
    strict: bool = False,
) -> None:
    """`text_columns` hold text and `list_columns` lists in a Parquet file's `schema`; a column of
    another type, or missing, is a `ConfigError` naming the file and the column (a type is the whole
    file's, not a row's). `strict`: ``bad_rows: error`` (the message then says nothing of skipping)."""
    _require_columns(path, list(schema.names), text_columns + list_columns, key=key, strict=strict)
    for column, ok, what in [(c, _is_text, "text") for c in text_columns] + [
        (c, _is_list, "a list") for c in list_columns
    ]:
        kind = schema.field(column).type
        if not ok(kind):
            why = "" if strict else ", so bad_rows: skip cannot leave rows out for it"
            raise ConfigError(
                key,
                str(path),
                f"column {column!r} holds {kind}, not {what}: a Parquet column has one type for the whole "
                f"file{why}; convert the column",
            )


def read_parquet_schema(path: Path, *, key: str) -> Any:
    try:
        return _parquet().read_schema(path)
    except Exception as e:  # noqa: BLE001 - an unreadable file is named with its reader's reason
        raise ConfigError(key, str(path), f"cannot be read as Parquet ({type(e).__name__}: {e})") from None


def read_parquet_rows(
    path: Path, *, text_columns: tuple[str, ...], list_columns: tuple[str, ...], key: str
) -> Rows:
    """The rows of a Parquet file, its columns checked first (`check_parquet_columns`)."""
    schema = read_parquet_schema(path, key=key)
    check_parquet_columns(path, schema, text_columns=text_columns, list_columns=list_columns, key=key)
    return _parquet().read_table(path).to_pylist(), Counter()


def read_text_lines(path: Path, *, column: str) -> Rows:
    """One row per line of a plain-text file (``{column: line}``); lines that are not UTF-8 counted."""
    rows: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    for line in path.read_bytes().splitlines():
        try:
            rows.append({column: line.decode("utf-8")})
        except UnicodeDecodeError:
            skipped["encoding"] += 1
    return rows, skipped


def split_data_files(directory: Path, *, name: str | None, split: str, key: str) -> list[Path]:
    """The data files of `split` (``train[:10%]`` -> train) in a dataset folder (a Hub snapshot), as
    `datasets` itself finds them (file names, or the README's configs)."""
    datasets = optional("datasets", needed_for="a Hub dataset or a folder of data files")

    base = split.split("[", 1)[0]
    try:
        builder = datasets.load_dataset_builder(str(directory), name=name)
    except Exception as e:  # noqa: BLE001 - a folder datasets cannot read is a config problem
        raise ConfigError(
            key, str(directory), f"cannot be read as a dataset ({type(e).__name__}: {e})"
        ) from None
    files = (builder.config.data_files or {}).get(base)
    if not files:
        found = ", ".join(sorted(builder.config.data_files or {})) or "none"
        raise ConfigError(key, str(directory), f"has no data files for split {base!r} (splits: {found})")
    return [Path(str(f)) for f in files]
