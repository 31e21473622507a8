"""The dataset-kind registry: what a ``dataset:`` / ``validation_dataset:`` section can be.

A kind is chosen by the section's ``source:`` value, or by a NeMo AutoModel ``_target_`` (its last
dotted name, e.g. ``...megatron_dataset.MegatronPretraining``). Each kind names:

- ``section`` / ``validation_section``: the dataclasses that parse and validate its keys;
- ``build``: ``"module:function"`` called as ``f(section, tokenizer, *, packed_sequence_size, seed)``
  -> a dataset with ``len`` and ``batch(indices) -> (input_ids, labels, position_ids)``, and
  optionally ``sample_order`` (see `sample_order`) for the training sampler; or, for a stream
  without a length, an object whose ``loader(global_batch_size=, local_batch_size=, dp_rank=,
  dp_size=)`` gives the rank's stateful loader (``next_step``, ``state_dict``, ``load_state_dict``);
- ``check_paths``: ``"module:function"`` called as ``f(section)`` in the launching process to
  refuse missing or unreadable files before any rank starts (``recipes validate`` skips it);
- ``check_rows`` (optional): ``"module:function"`` called as ``f(section)`` where the run's files are
  read before launch, to refuse the first bad row of its local files;
- ``count_rows`` (optional): ``"module:function"`` called as ``f(section, tokenizer, *,
  packed_sequence_size, seed, at_least)`` before launch -> the rows ``build`` gives, or `at_least`
  once that many are certain, by the builder's own code (`row_counts` checks the training set's
  rows against ``global_batch_size`` with it); None: counted only where the ranks build it (a
  stream has no length).

Builders are named, not imported, so parsing a config imports no data library.

To add a kind: write its section dataclass(es) (frozen, validated in ``__post_init__`` without
reading the disk: the built-in ones live in automodel-data, `automodel.data.*_sections`, and in
`automodel.recipes.config.hub_datasets`) and a builder module, then
one `register(...)` below (or from your own module). The recipe config, the loader, the trainer and the CLI's path
check all go through `parse_section`, `build_dataset` and `check_paths`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from automodel.data.pretrain_sections import (
    MegatronPretrainingSection,
    MegatronPretrainingValidationSection,
    NanogptSection,
    NanogptValidationSection,
)
from automodel.data.streaming_section import StreamingSection, StreamingValidationSection
from automodel.data.text_sections import (
    DATA_SOURCES,
    SFT_SOURCES,
    SFT_TARGETS,
    DatasetSection,
    SFTDatasetSection,
    SFTValidationDatasetSection,
    ValidationDatasetSection,
)
from automodel.recipes.config.hub_datasets import (
    HellaSwagSection,
    HellaSwagValidationSection,
    SquadSection,
    SquadValidationSection,
)
from automodel.recipes.config.recipe import DatasetConfig
from automodel.recipes.config.sections import build_section
from automodel.recipes.errors import ConfigError

#: A kind's training and validation section classes (each a `DatasetConfig`).
S = TypeVar("S", bound=DatasetConfig)
V = TypeVar("V", bound=DatasetConfig)


@dataclass(frozen=True)
class DatasetKind(Generic[S, V]):
    """One kind, generic over its section classes: its hooks are called with an instance of one."""

    name: str
    sources: tuple[str, ...]  # ``source:`` values that select this kind
    targets: Mapping[str, str]  # NeMo AutoModel ``_target_`` class name -> the ``source`` it means
    section: type[S]
    validation_section: type[V]
    build: str  # "module:function"
    check_paths: str  # "module:function"
    #: "module:function" called as ``f(section)`` with the run's files (not by ``recipes validate``):
    #: the first bad row of its local files before any rank starts; None: it reads no row files.
    check_rows: str | None = None
    #: "module:function" counting the rows before launch (see the module docstring); None: not counted.
    count_rows: str | None = None


#: Each kind over its own section classes: `DatasetKind[Any, Any]`.
_KINDS: list[DatasetKind[Any, Any]] = []


def register(kind: DatasetKind[S, V]) -> DatasetKind[S, V]:
    """Add `kind`; its sources and targets must not be claimed by another kind."""
    for other in _KINDS:
        clash = (set(kind.sources) & set(other.sources)) | (set(kind.targets) & set(other.targets))
        if clash:
            raise ValueError(f"dataset kind {kind.name!r} claims {sorted(clash)}, already {other.name!r}'s")
    _KINDS.append(kind)
    return kind


def kinds() -> tuple[DatasetKind[Any, Any], ...]:
    return tuple(_KINDS)


def _call(ref: str, *args: Any, **kwargs: Any) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


def kind_for(data: Any, *, key: str) -> tuple[DatasetKind[Any, Any], Any]:
    """The kind a raw section selects, and the section with ``_target_`` replaced by its ``source``."""
    if isinstance(data, dict) and "_target_" in data:
        target = data["_target_"]
        name = str(target).rsplit(".", 1)[-1] if isinstance(target, str) else None
        kind = next((k for k in _KINDS if name in k.targets), None)
        if kind is None:
            known = ", ".join(t for k in _KINDS for t in k.targets)
            raise ConfigError(
                f"{key}._target_", target, f"is not a dataset class read here ({known}); or set {key}.source"
            )
        source = kind.targets[name]
        if data.get("source", source) != source:
            raise ConfigError(f"{key}.source", data["source"], f"contradicts {key}._target_={target}")
        data = {**{k: v for k, v in data.items() if k != "_target_"}, "source": source}
    source = data.get("source") if isinstance(data, dict) else None
    for kind in _KINDS:
        if source in kind.sources:
            return kind, data
    if source is None:
        return _KINDS[0], data  # the default kind (its section's default source)
    known = ", ".join(s for k in _KINDS for s in k.sources)
    raise ConfigError(f"{key}.source", source, f"must be one of {known}")


def parse_section(data: object, *, validation: bool) -> DatasetConfig:
    """The typed section for a raw ``dataset:`` (or ``validation_dataset:``) mapping."""
    kind, data = kind_for(data, key="validation_dataset" if validation else "dataset")
    return build_section(kind.validation_section if validation else kind.section, data)


def kind_of(section: DatasetConfig) -> DatasetKind[Any, Any]:
    for kind in _KINDS:
        if isinstance(section, kind.section | kind.validation_section):
            return kind
    raise TypeError(f"{type(section).__name__} is not the section of a registered dataset kind")


def build_dataset(section: DatasetConfig, tokenizer: Any, *, packed_sequence_size: int, seed: int) -> Any:
    return _call(
        kind_of(section).build, section, tokenizer, packed_sequence_size=packed_sequence_size, seed=seed
    )


def build_packed_dataset(
    section: DatasetConfig, tokenizer: Any, *, packed_sequence_size: int, seed: int = 0
) -> Any:
    """The section's dataset (``len`` and ``batch(indices)``), built by its kind."""
    return build_dataset(section, tokenizer, packed_sequence_size=packed_sequence_size, seed=seed)


def check_paths(section: DatasetConfig | None) -> None:
    if section is not None:
        _call(kind_of(section).check_paths, section)


def check_rows(section: DatasetConfig | None) -> None:
    """The section's kind's row check (`DatasetKind.check_rows`), where it has one."""
    if section is not None and (ref := kind_of(section).check_rows) is not None:
        _call(ref, section)


def count_rows(
    section: DatasetConfig, tokenizer: Any, *, packed_sequence_size: int, seed: int, at_least: int
) -> int | None:
    """The section's kind's row count (`DatasetKind.count_rows`): the rows its dataset has, or
    `at_least` when it has at least that many; None for a kind counted only in the ranks."""
    ref = kind_of(section).count_rows
    if ref is None:
        return None
    return _call(
        ref, section, tokenizer, packed_sequence_size=packed_sequence_size, seed=seed, at_least=at_least
    )


def _register_builtin() -> None:
    loader = "automodel.data.text_build"
    build = "automodel.data.pretrain_build"
    rows = "automodel.data.file_check"
    register(DatasetKind("text", DATA_SOURCES, {}, DatasetSection, ValidationDatasetSection,
                         f"{loader}:build_text_dataset", f"{loader}:check_text_paths",
                         f"{rows}:check_text_rows", f"{loader}:count_text_rows"))  # fmt: skip
    register(DatasetKind("sft", SFT_SOURCES, SFT_TARGETS,
                         SFTDatasetSection, SFTValidationDatasetSection,
                         f"{loader}:build_sft_rows", f"{loader}:check_sft_paths",
                         f"{rows}:check_sft_rows", f"{loader}:count_sft_section_rows"))  # fmt: skip
    register(DatasetKind("megatron", ("megatron",), dict.fromkeys(("MegatronPretraining", "MegatronPretrainingConfig"), "megatron"),
                         MegatronPretrainingSection, MegatronPretrainingValidationSection,
                         f"{build}:build_megatron", f"{build}:check_megatron_paths",
                         count_rows=f"{build}:count_megatron_rows"))  # fmt: skip
    register(DatasetKind("nanogpt", ("nanogpt",), dict.fromkeys(("NanogptDataset", "NanogptDatasetConfig"), "nanogpt"),
                         NanogptSection, NanogptValidationSection,
                         f"{build}:build_nanogpt", f"{build}:check_nanogpt_paths",
                         count_rows=f"{build}:count_nanogpt_rows"))  # fmt: skip

    stream = "automodel.data.streaming"
    register(DatasetKind("streaming", ("streaming",), {}, StreamingSection, StreamingValidationSection,
                         f"{stream}:build_streaming", f"{stream}:check_streaming_paths"))  # fmt: skip
    hub = "automodel.recipes.compat.datasets"  # NeMo AutoModel's make_squad_dataset and HellaSwag
    register(DatasetKind("squad", ("squad",), {"make_squad_dataset": "squad"}, SquadSection,
                         SquadValidationSection, f"{hub}:build_squad", f"{hub}:check_paths",
                         count_rows=f"{hub}:count_squad"))  # fmt: skip
    register(DatasetKind("hellaswag", ("hellaswag",), {"HellaSwag": "hellaswag", "HellaSwagConfig": "hellaswag"},
                         HellaSwagSection, HellaSwagValidationSection, f"{hub}:build_hellaswag",
                         f"{hub}:check_paths", count_rows=f"{hub}:count_hellaswag"))  # fmt: skip


_register_builtin()
