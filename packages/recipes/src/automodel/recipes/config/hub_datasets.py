"""YAML sections of NeMo AutoModel's SQuAD and HellaSwag dataset factories (kinds ``squad`` and
``hellaswag``; their builders are `compat.datasets`')."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from automodel.data.text_sections import TRUNCATION, check_padding, positive
from automodel.recipes.errors import ConfigError


@dataclass(frozen=True)
class SquadSection:
    """``make_squad_dataset``'s keys. ``dataset_name`` is a local directory or file(s), or a Hub id
    in the local cache; ``split`` may slice (``train[:1000]``)."""

    SECTION: ClassVar[str] = "dataset"
    PATH_KEY: ClassVar[str] = "dataset_name"
    source: str = "squad"
    dataset_name: str | list = "rajpurkar/squad"
    split: str = "train"
    seq_length: int = 1024
    limit_dataset_samples: int | None = None
    padding: bool | str = False
    truncation: bool | str = False
    chat_template: str | None = None
    use_hf_chat_template: bool | None = None
    answer_only_loss_mask: bool = True
    fp8: bool = False  # unused by AutoModel's factory too
    tokenizer: dict | None = None
    name: ClassVar[None] = None

    def __post_init__(self) -> None:
        _check_common(self)

    @property
    def path_or_dataset_id(self) -> str | list:
        return self.dataset_name

    @property
    def truncate(self) -> bool:
        return TRUNCATION[self.truncation]


@dataclass(frozen=True)
class SquadValidationSection(SquadSection):
    SECTION: ClassVar[str] = "validation_dataset"
    split: str = "validation"


@dataclass(frozen=True)
class HellaSwagSection:
    """``HellaSwag``'s keys; ``num_samples_limit`` keeps the first N rows of the split."""

    SECTION: ClassVar[str] = "dataset"
    PATH_KEY: ClassVar[str] = "path_or_dataset"
    source: str = "hellaswag"
    path_or_dataset: str | list = "rowan/hellaswag"
    split: str = "train"
    seq_length: int = 1024
    num_samples_limit: int | None = None
    pad_to_max_length: bool = True
    truncation: bool | str = False
    answer_only_loss_mask: bool = True
    tokenizer: dict | None = None
    name: ClassVar[None] = None
    chat_template: ClassVar[None] = None
    use_hf_chat_template: ClassVar[bool] = False  # AutoModel's preprocessor joins ctx and ending tokens

    def __post_init__(self) -> None:
        _check_common(self)

    @property
    def path_or_dataset_id(self) -> str | list:
        return self.path_or_dataset

    @property
    def limit_dataset_samples(self) -> int | None:
        return self.num_samples_limit

    @property
    def truncate(self) -> bool:
        return TRUNCATION[self.truncation]


@dataclass(frozen=True)
class HellaSwagValidationSection(HellaSwagSection):
    SECTION: ClassVar[str] = "validation_dataset"
    split: str = "validation"


def _check_common(section: SquadSection | HellaSwagSection) -> None:
    s = section.SECTION
    path = section.path_or_dataset_id
    if not (isinstance(path, str) and path) and not (
        isinstance(path, list) and path and all(isinstance(p, str) and p for p in path)
    ):
        raise ConfigError(f"{s}.{section.PATH_KEY}", path, "must be a path, a list of paths or a Hub id")
    if not isinstance(section.split, str) or not section.split:
        raise ConfigError(
            f"{s}.split", section.split, "must be a split name, optionally sliced (train[:100])"
        )
    check_padding(
        s,
        padding=getattr(section, "padding", False),
        pad_to_max_length=getattr(section, "pad_to_max_length", False),
    )
    if section.truncation not in TRUNCATION or type(section.truncation) is int:
        raise ConfigError(
            f"{s}.truncation",
            section.truncation,
            "must be false / do_not_truncate, or true / longest_first / right",
        )
    positive(s, "seq_length", section.seq_length, minimum=2)
    limit_key = "num_samples_limit" if hasattr(section, "num_samples_limit") else "limit_dataset_samples"
    positive(s, limit_key, section.limit_dataset_samples, allow_none=True)
    for key in ("answer_only_loss_mask", "fp8"):
        if not isinstance(getattr(section, key, False), bool):
            raise ConfigError(f"{s}.{key}", getattr(section, key), "must be true or false")
