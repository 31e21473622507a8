"""`recipes preprocess` inputs: files, folders or a cached Hub dataset -> a deterministic list of tasks.

A task is one output shard: a byte range of a JSON-lines or text file (cut at line boundaries by
the reader), a range of parquet row groups, or a whole JSON-array file. The list depends only on
the inputs and the shard size, so a restarted run plans the same tasks and skips finished ones.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from automodel.data.errors import ConfigError, optional
from automodel.data.hub_cache import is_hub_id, resolve_local_or_cached

FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


@dataclass(frozen=True)
class Task:
    """Documents of `path` in `[start, stop)`: bytes (jsonl, text) or row groups (parquet)."""

    index: int
    path: str
    format: str
    start: int
    stop: int
    size: int  # the file's size and mtime when planned: a changed input is not a finished shard
    mtime_ns: int
    nbytes: int  # input bytes this task covers (parquet: its row groups' uncompressed size)

    @property
    def name(self) -> str:
        return f"shard_{self.index:05d}"

    def key(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "index"}


def _file_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt == "json":  # JSON lines saved as .json, or one JSON array
        with path.open("rb") as f:
            head = f.read(4096).lstrip()
        fmt = "json" if head.startswith(b"[") else "jsonl"
    if fmt is None:
        raise ConfigError("preprocess input", str(path), f"has no known format ({', '.join(FORMATS)})")
    return fmt


def input_files(inputs: list[str]) -> list[Path]:
    """Files named, found in folders (recursively, known suffixes), or in a cached Hub dataset."""
    files: list[Path] = []
    for name in inputs:
        p = Path(name).expanduser()
        if not p.exists():
            if not is_hub_id(name):
                raise ConfigError("preprocess input", name, "does not exist")
            p = Path(resolve_local_or_cached(name, key="preprocess input", repo_type="dataset"))
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in FORMATS)
            if not found:
                raise ConfigError("preprocess input", name, f"holds no {', '.join(FORMATS)} files")
            files += found
        else:
            files.append(p)
    return files


def plan_tasks(files: list[Path], *, shard_bytes: int) -> list[Task]:
    """One task per `shard_bytes` of each input (whole files for JSON arrays; row groups for parquet)."""
    tasks: list[Task] = []
    for path in files:
        st = path.stat()
        fmt = _file_format(path)
        if st.st_size == 0:
            continue
        if fmt in ("jsonl", "text"):
            ranges = [(a, min(a + shard_bytes, st.st_size)) for a in range(0, st.st_size, shard_bytes)]
            nbytes = [b - a for a, b in ranges]
        elif fmt == "parquet":
            meta = optional("pyarrow.parquet", needed_for="a Parquet input").ParquetFile(path).metadata
            groups, per = meta.num_row_groups, 0
            sizes = [meta.row_group(i).total_byte_size for i in range(groups)]
            ranges, first = [], 0
            if groups == 0:
                continue
            for i, b in enumerate(sizes):
                per += b
                if per >= shard_bytes or i == groups - 1:
                    ranges.append((first, i + 1))
                    first, per = i + 1, 0
            nbytes = [sum(sizes[a:b]) for a, b in ranges]
        else:
            ranges, nbytes = [(0, st.st_size)], [st.st_size]
        for (a, b), n in zip(ranges, nbytes):
            tasks.append(Task(len(tasks), str(path), fmt, a, b, st.st_size, st.st_mtime_ns, n))
    return tasks


def read_documents(task: Task, *, text_key: str):
    """Yield the task's texts (a missing `text_key` is an error naming the file and line)."""
    if task.format == "parquet":
        pf = optional("pyarrow.parquet", needed_for="a Parquet input").ParquetFile(task.path)
        if text_key not in pf.schema_arrow.names:
            raise ConfigError(
                "--text-key", text_key, f"is not a column of {task.path} ({', '.join(pf.schema_arrow.names)})"
            )
        for g in range(task.start, task.stop):
            yield from pf.read_row_group(g, columns=[text_key]).column(0).to_pylist()
        return
    if task.format == "json":
        rows = json.loads(Path(task.path).read_text(encoding="utf-8"))
        for i, row in enumerate(rows):
            yield _field(row, text_key, task.path, f"item {i}")
        return
    with open(task.path, "rb") as f:
        if task.start > 0:
            f.seek(task.start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line that began before this task belongs to the previous one
        pos = f.tell()
        while pos < task.stop:
            line = f.readline()
            if not line:
                break
            pos += len(line)
            if task.format == "text":
                yield line.decode("utf-8", errors="replace").rstrip("\r\n")
            elif line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(
                        "preprocess input", task.path, f"byte {pos - len(line)}: not a JSON line ({e.msg})"
                    ) from None
                yield _field(row, text_key, task.path, f"byte {pos - len(line)}")


def _field(row: object, text_key: str, path: str, where: str) -> object:
    if not isinstance(row, dict) or text_key not in row:
        keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
        raise ConfigError("--text-key", text_key, f"is missing in {path} at {where} (has: {keys})")
    return row[text_key]
