"""Local JSON-lines and text data files, read once before launch: a bad row is named by file and line.

Read by `datasets`/pyarrow inside every rank, a non-UTF-8 byte gave a 168-line traceback, a
malformed line named the file but not the line, three integer answers made pyarrow reject the
whole file, and an empty file surfaced as a ``global_batch_size`` problem. Here each is one
`DataError` naming the file, the line and what is wrong with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from automodel.recipes.errors import DataError

JSON_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt",)


def _rows(path: Path, limit: int | None) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed row)`` of a JSON-lines file (or of a .json file holding one array)."""
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
        text = _decode(path, line, line_offset=lineno)
        try:
            yield lineno, json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
        count += 1
        if limit is not None and count >= limit:
            return


def _decode(path: Path, data: bytes, *, line_offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line_offset or data[: e.start].count(b"\n") + 1
        where = f"{path}:{line}"
        raise DataError(
            f"{where}: not UTF-8 (byte 0x{data[e.start]:02x} at column {e.start + 1}); "
            "re-encode the file as UTF-8"
        ) from None


def check_json_rows(path: Path, *, text_columns: tuple[str, ...], limit: int | None = None) -> int:
    """Every row of `path` is a JSON object whose `text_columns` (where present) hold text.

    Returns the number of rows; raises `DataError` naming the file and line of the first bad one.
    """
    n = 0
    for lineno, row in _rows(path, limit):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: a row must be a JSON object, got {type(row).__name__}")
        for column in text_columns:
            value = row.get(column)
            if value is not None and not isinstance(value, str):
                raise DataError(
                    f"{path}:{lineno}: column {column!r} holds {type(value).__name__} {value!r:.40}, not text"
                )
        n += 1
    if n == 0:
        raise DataError(f"{path} holds no rows (an empty file)")
    return n


def check_text_file(path: Path) -> None:
    """A plain text file: UTF-8 and not empty."""
    raw = path.read_bytes()
    _decode(path, raw, line_offset=0)
    if not raw.strip():
        raise DataError(f"{path} holds no text (an empty file)")


def check_section_files(section: Any) -> None:
    """The local files of a dataset section (pretraining ``path`` or SFT ``path_or_dataset_id``)."""
    source = getattr(section, "source", None)  # kinds without one (megatron, nanogpt) read binary shards
    if section is None or source not in ("instruction", "chat", "json", "text"):
        return
    if hasattr(section, "path_or_dataset_id"):  # SFT
        src = section.path_or_dataset_id
        files = [Path(p).expanduser() for p in (src if isinstance(src, list) else [src])]
        mapping = section.column_mapping or {}
        columns = tuple(str(c) for c in mapping.values()) if section.source == "instruction" else ()
        limit = section.limit_dataset_samples
    else:
        if section.path is None:
            return
        files = [Path(p) for p in (section.path if isinstance(section.path, list) else [section.path])]
        columns = (section.text_key,) if section.source == "json" else ()
        limit = None
    for f in files:
        if not f.is_file():
            continue  # a directory or a Hub id: read by `datasets` itself
        if f.suffix in JSON_SUFFIXES:
            check_json_rows(f, text_columns=columns, limit=limit)
        elif f.suffix in TEXT_SUFFIXES or source == "text":
            check_text_file(f)
