"""NeMo AutoModel's SQuAD and HellaSwag dataset factories as dataset kinds, reading the datasets'
own nested columns, so a Hub snapshot (or local files with the same columns) needs no conversion.

- ``make_squad_dataset`` (kind ``squad``): ``context``, ``question``, ``answers.text[0]``; the prompt
  ``"Context: {context} Question: {question} Answer: "`` (as a user turn with a chat template),
  the answer the label.
- ``HellaSwag`` (kind ``hellaswag``): ``ctx`` as the prompt, ``endings[int(label)]`` the label.

Both then go through the SFT pipeline (`data.sft`): rows of ``seq_length`` tokens, answer-only
loss, packing with ``packed_sequence``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from automodel.recipes.errors import ConfigError
from automodel.recipes.hub_cache import resolve_local_or_cached
from automodel.recipes.sections import TRUNCATION, _positive, check_padding


@dataclass
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


@dataclass
class SquadValidationSection(SquadSection):
    SECTION: ClassVar[str] = "validation_dataset"
    split: str = "validation"


@dataclass
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


@dataclass
class HellaSwagValidationSection(HellaSwagSection):
    SECTION: ClassVar[str] = "validation_dataset"
    split: str = "validation"


def _check_common(section: Any) -> None:
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
    _positive(s, "seq_length", section.seq_length, minimum=2)
    limit_key = "num_samples_limit" if hasattr(section, "num_samples_limit") else "limit_dataset_samples"
    _positive(s, limit_key, section.limit_dataset_samples, allow_none=True)
    for key in ("answer_only_loss_mask", "fp8"):
        if not isinstance(getattr(section, key, False), bool):
            raise ConfigError(f"{s}.{key}", getattr(section, key), "must be true or false")


def _column(section: Any, ds: Any, name: str) -> list[Any]:
    if name not in ds.column_names:
        raise ConfigError(
            f"{section.SECTION}.{section.PATH_KEY}",
            section.path_or_dataset_id,
            f"has no {name!r} column (columns: {', '.join(ds.column_names)}); is it {section.source}?",
        )
    return ds[name]


def squad_records(section: Any, ds: Any) -> list[dict[str, str]]:
    """SQuAD rows -> (prompt, answer): the first of ``answers.text`` (stripped), as AutoModel."""
    contexts, questions, answers = (_column(section, ds, c) for c in ("context", "question", "answers"))
    out = []
    for context, question, answer in zip(contexts, questions, answers, strict=True):
        texts = answer.get("text") if isinstance(answer, dict) else None
        out.append(
            {
                "prompt": f"Context: {context} Question: {question} Answer: ",
                "answer": texts[0].strip() if texts else "",
            }
        )
    return out


def hellaswag_records(section: Any, ds: Any) -> list[dict[str, str]]:
    """HellaSwag rows -> (prompt, answer): ``ctx`` and ``endings[int(label)]``, as AutoModel."""
    ctxs, endings, labels = (_column(section, ds, c) for c in ("ctx", "endings", "label"))
    out = []
    for ctx, options, label in zip(ctxs, endings, labels, strict=True):
        try:
            answer = options[int(label)]
        except (ValueError, TypeError, IndexError):
            answer = ""  # an unlabeled row (HellaSwag's test split): skipped as "empty answer"
        out.append({"prompt": ctx, "answer": answer})
    return out


def build_squad(section: Any, tokenizer: Any, *, packed_sequence_size: int, seed: int) -> Any:
    return _build(section, tokenizer, packed_sequence_size=packed_sequence_size, records=squad_records)


def build_hellaswag(section: Any, tokenizer: Any, *, packed_sequence_size: int, seed: int) -> Any:
    return _build(section, tokenizer, packed_sequence_size=packed_sequence_size, records=hellaswag_records)


def _build(section: Any, tokenizer: Any, *, packed_sequence_size: int, records: Any) -> Any:
    # lazy: cycle recipes.compat.datasets -> recipes.data.kinds -> recipes.compat.datasets (kinds registers these kinds at import)
    from automodel.recipes.data.sft import _load_table, build_sft_dataset

    rows = records(section, _load_table(section))
    return build_sft_dataset(section, tokenizer, packed_sequence_size=packed_sequence_size, records=rows)


def check_paths(section: Any) -> None:
    """Local files must exist; anything else must be a directory or a Hub id in the local cache."""
    src = section.path_or_dataset_id
    key = f"{section.SECTION}.{section.PATH_KEY}"
    for p in src if isinstance(src, list) else []:
        if not Path(p).expanduser().is_file():
            raise ConfigError(key, p, "does not exist (only local files are read from a list)")
    if isinstance(src, str) and not Path(src).expanduser().exists():
        resolve_local_or_cached(src, key=key, repo_type="dataset")


def register_kinds() -> None:
    """Add the ``squad`` and ``hellaswag`` kinds to `data.kinds` (called by its built-in registration)."""
    # lazy: cycle recipes.compat.datasets -> recipes.data.kinds -> recipes.compat.datasets (kinds registers these kinds at import)
    from automodel.recipes.data.kinds import DatasetKind, register

    here = "automodel.recipes.compat.datasets"
    register(DatasetKind("squad", ("squad",), {"make_squad_dataset": "squad"}, SquadSection,
                         SquadValidationSection, f"{here}:build_squad", f"{here}:check_paths"))  # fmt: skip
    register(DatasetKind("hellaswag", ("hellaswag",), {"HellaSwag": "hellaswag", "HellaSwagConfig": "hellaswag"},
                         HellaSwagSection, HellaSwagValidationSection, f"{here}:build_hellaswag",
                         f"{here}:check_paths"))  # fmt: skip
