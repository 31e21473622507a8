"""Sections of the text and SFT kinds (frozen, validated on creation, NeMo AutoModel's key names):
`DatasetSection` (pretraining text: the built-in corpus or json / text / parquet files) and
`SFTDatasetSection` (instruction columns, chat ``messages``, or the built-in stdlib set)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from automodel.data.errors import ConfigError


def positive(section: str, name: str, value: object, *, allow_none: bool = False, minimum: float = 1) -> None:
    """``<section>.<name>`` is a number >= `minimum` (or None where allowed)."""
    if value is None and allow_none:
        return
    if not isinstance(value, int | float) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{section}.{name}", value, f"must be >= {minimum}")


DATA_SOURCES = ("embedded", "json", "text", "parquet")
#: ``bad_rows`` values; skip reads the rows itself: JSON, CSV and Parquet files (SFT), and the
#: json / text / parquet pretraining sources
BAD_ROWS = ("error", "skip")
SKIP_SOURCES = ("json", "text", "parquet")


def check_bad_rows_key(section: DatasetSection | SFTDatasetSection, paths: str | list | None) -> None:
    """``bad_rows`` is error or skip, and skip names a source or files it can read row by row (which
    files those are is the pre-launch check's, `data.file_check.check_bad_rows_files`)."""
    key = f"{section.SECTION}.bad_rows"
    if section.bad_rows not in BAD_ROWS:
        raise ConfigError(key, section.bad_rows, "must be error or skip")
    if section.bad_rows != "skip":
        return
    if isinstance(section, DatasetSection):  # pretraining: the rows' kind is the source's
        if section.source not in SKIP_SOURCES:
            raise ConfigError(
                key, "skip", f"applies to the {', '.join(SKIP_SOURCES)} sources, not {section.source}"
            )
        return
    if not [p for p in (paths if isinstance(paths, list) else [paths]) if p is not None]:
        raise ConfigError(key, "skip", f"applies to data files, not the {section.source} source")


@dataclass(frozen=True)
class DatasetSection:
    """Where training text comes from; `embedded` needs nothing from a hub."""

    SECTION: ClassVar[str] = "dataset"
    source: str = "embedded"
    path: str | list | None = None
    text_key: str = "text"
    seq_length: int = 128
    split: str = "train"
    # opt-in cap on the text read (characters, whole documents): unset, every document is read
    # (``embedded``: its fixed 2,000,000 characters); set, the start-up line says what was left out
    max_bytes: int | None = None
    max_rows: int | None = None
    # error: a bad JSON row stops the run naming file:line; skip: it is left out, counted per reason
    bad_rows: str = "error"

    def __post_init__(self) -> None:
        s = self.SECTION
        check_bad_rows_key(self, self.path)
        if self.source not in DATA_SOURCES:
            raise ConfigError(f"{s}.source", self.source, f"must be one of {', '.join(DATA_SOURCES)}")
        if self.source != "embedded" and self.path is None:
            raise ConfigError(f"{s}.path", None, f"is required for source {self.source!r}")
        if self.split not in ("train", "validation"):
            raise ConfigError(f"{s}.split", self.split, "must be train or validation")
        positive(s, "seq_length", self.seq_length, minimum=2)
        positive(s, "max_bytes", self.max_bytes, minimum=1024, allow_none=True)
        positive(s, "max_rows", self.max_rows, allow_none=True)


@dataclass(frozen=True)
class ValidationDatasetSection(DatasetSection):
    SECTION: ClassVar[str] = "validation_dataset"
    split: str = "validation"


PADDING = (False, True, "do_not_pad", "max_length", "longest")


def check_padding(section: str, *, padding: object, pad_to_max_length: object) -> None:
    """AutoModel's ``padding`` / ``pad_to_max_length``: valid values, none of which changes the loss."""
    if not any(padding is p for p in PADDING if isinstance(p, bool)) and padding not in PADDING[2:]:
        raise ConfigError(
            f"{section}.padding", padding, "must be false, true, do_not_pad, max_length or longest"
        )
    if not isinstance(pad_to_max_length, bool):
        raise ConfigError(f"{section}.pad_to_max_length", pad_to_max_length, "must be true or false")


SFT_SOURCES = ("instruction", "chat", "stdlib_docstrings")
#: NeMo AutoModel dataset classes (``dataset._target_``) and the source that reads the same data.
SFT_TARGETS = {"ColumnMappedTextInstructionDataset": "instruction", "ChatDataset": "chat"}
SFT_COLUMNS = {"instruction": ("context", "question", "answer"), "chat": ("messages",)}
TRUNCATION = {False: False, "do_not_truncate": False, True: True, "longest_first": True, "right": True}


@dataclass(frozen=True)
class SFTDatasetSection:
    """Supervised fine-tuning examples: instruction columns, chat ``messages``, or a built-in set.

    ``instruction`` maps columns onto ``context`` / ``question`` / ``answer`` (NeMo AutoModel's
    ColumnMappedTextInstructionDataset); ``chat`` reads a ``messages`` column in the OpenAI chat
    format (NeMo's ChatDataset); ``stdlib_docstrings`` builds (function signature -> first line of its
    docstring) pairs from the Python standard library at run time. Each example is one row of at
    most ``seq_length`` tokens, a micro-batch padded to its longest example (padding carries no
    loss), or several per row with ``packed_sequence``.
    """

    SECTION: ClassVar[str] = "dataset"
    source: str = "instruction"
    # local .jsonl/.json/.parquet/.csv file(s) or a directory, or a Hub dataset id from the local cache
    path_or_dataset_id: str | list | None = None
    column_mapping: dict | None = None
    split: str = "train"  # for a Hub id or a directory (local files are one split), stdlib: train/validation
    name: str | None = None  # dataset configuration (subset) of a Hub id or directory
    answer_only_loss_mask: bool = True
    # AutoModel's ChatDataset key: false (its default) labels each assistant turn as the template renders
    # it, role header included; true leaves out what the generation prompt writes (the role header)
    mask_generation_prompt: bool = False
    # null: the tokenizer's chat template when it has one, else plain "context\nquestion\n" + answer
    use_hf_chat_template: bool | None = None
    chat_template: str | None = None  # a Jinja template that replaces the tokenizer's (saved with it)
    seq_length: int = 128
    # false / do_not_truncate: an example longer than the row is skipped (counted and reported);
    # true / longest_first / right: its end is cut off (skipped if no answer token is left)
    truncation: bool | str = False
    limit_dataset_samples: int | None = None
    # AutoModel's padding keys: rows here are always padded to one length, and padding carries no
    # loss, so every value gives the same loss (checked, not used).
    padding: bool | str = False
    pad_to_max_length: bool = False
    # AutoModel's per-dataset tokenizer: becomes the run's tokenizer (a different one is an error)
    tokenizer: dict | None = None
    shuffle_seed: int | None = None  # shuffle the rows with this seed before limit_dataset_samples
    # error: a bad JSON row stops the run naming file:line; skip: it is left out, counted per reason
    bad_rows: str = "error"

    PATH_KEY: ClassVar[str] = "path_or_dataset_id"

    def __post_init__(self) -> None:
        s = self.SECTION
        check_bad_rows_key(self, self.path_or_dataset_id)
        check_padding(s, padding=self.padding, pad_to_max_length=self.pad_to_max_length)
        if self.source not in SFT_SOURCES:
            raise ConfigError(f"{s}.source", self.source, f"must be one of {', '.join(SFT_SOURCES)}")
        if self.source == "stdlib_docstrings":
            if self.path_or_dataset_id is not None or self.column_mapping is not None:
                key = "path_or_dataset_id" if self.path_or_dataset_id is not None else "column_mapping"
                raise ConfigError(f"{s}.{key}", getattr(self, key), "is not used by source stdlib_docstrings")
            if self.split not in ("train", "validation"):
                raise ConfigError(
                    f"{s}.split", self.split, "must be train or validation for stdlib_docstrings"
                )
        elif self.path_or_dataset_id is None:
            raise ConfigError(f"{s}.path_or_dataset_id", None, f"is required for source {self.source!r}")
        if isinstance(self.path_or_dataset_id, list) and (
            not self.path_or_dataset_id or not all(isinstance(p, str) for p in self.path_or_dataset_id)
        ):
            raise ConfigError(
                f"{s}.path_or_dataset_id", self.path_or_dataset_id, "must be a path or a list of paths"
            )
        if self.column_mapping is not None:
            allowed = SFT_COLUMNS.get(self.source, ())
            for role, column in self.column_mapping.items():
                if role not in allowed:
                    raise ConfigError(
                        f"{s}.column_mapping.{role}",
                        column,
                        f"is not a role of source {self.source!r} ({', '.join(allowed)})",
                    )
                if not isinstance(column, str) or not column:
                    raise ConfigError(f"{s}.column_mapping.{role}", column, "must be a column name")
        if self.source == "instruction":
            mapping = self.column_mapping or {}
            if "answer" not in mapping:
                raise ConfigError(
                    f"{s}.column_mapping.answer", None, "is required (the column holding the answer)"
                )
            if "context" not in mapping and "question" not in mapping:
                raise ConfigError(
                    f"{s}.column_mapping", mapping, "must map context or question (or both) besides answer"
                )
        for key in ("answer_only_loss_mask", "mask_generation_prompt"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{s}.{key}", getattr(self, key), "must be true or false")
        if (
            self.truncation not in TRUNCATION
            or isinstance(self.truncation, int)
            and not isinstance(self.truncation, bool)
        ):
            raise ConfigError(
                f"{s}.truncation",
                self.truncation,
                "must be false / do_not_truncate, or true / longest_first / right",
            )
        positive(s, "seq_length", self.seq_length, minimum=2)
        positive(s, "limit_dataset_samples", self.limit_dataset_samples, allow_none=True)

    @property
    def truncate(self) -> bool:
        return TRUNCATION[self.truncation]


@dataclass(frozen=True)
class SFTValidationDatasetSection(SFTDatasetSection):
    SECTION: ClassVar[str] = "validation_dataset"
    split: str = "validation"
