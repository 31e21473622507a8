"""YAML section of the streaming kind: local text files read with HF ``datasets`` streaming.

For corpora not preprocessed with ``recipes preprocess``: nothing is loaded at start-up, each dp
rank streams its own share of the files (whole files when their count divides the dp size, else
every dp-th document), tokenises on the fly and packs windows of ``seq_length + 1`` tokens across
document boundaries (stride ``seq_length``, as the Megatron kind). The position in the stream is
saved in every checkpoint, per rank, so a resumed run continues exactly; the stream is read in
file order (no shuffle: a shuffle buffer is not part of ``datasets``' resumable state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from automodel.data.errors import ConfigError

#: file suffix -> ``datasets`` builder
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


@dataclass(frozen=True)
class StreamingSection:
    """``source: streaming``; ``path`` files, folders or globs; ``format`` json | parquet | text
    (default: from the suffixes); ``text_key`` the text column (json / parquet)."""

    SECTION: ClassVar[str] = "dataset"
    STREAMING: ClassVar[bool] = True
    source: str = "streaming"
    path: str | list | None = None
    format: str | None = None
    text_key: str = "text"
    seq_length: int = 2048
    #: validation only: the windows read (from the start of the stream) and kept in memory
    max_rows: int = 256

    def __post_init__(self) -> None:
        s = self.SECTION
        paths = [self.path] if isinstance(self.path, str) else self.path
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
            raise ConfigError(
                f"{s}.path", self.path, "is required: a file, folder or glob, or a list of them"
            )
        if self.format is not None and self.format not in set(FORMATS.values()):
            raise ConfigError(f"{s}.format", self.format, "must be json, parquet or text")
        if not isinstance(self.text_key, str) or not self.text_key:
            raise ConfigError(f"{s}.text_key", self.text_key, "must be a column name")
        for key in ("seq_length", "max_rows"):
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (2 if key == "seq_length" else 1)
            ):
                raise ConfigError(f"{s}.{key}", value, f"must be an int >= {2 if key == 'seq_length' else 1}")

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path or ())


@dataclass(frozen=True)
class StreamingValidationSection(StreamingSection):
    SECTION: ClassVar[str] = "validation_dataset"
