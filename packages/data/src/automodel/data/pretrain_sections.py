"""Sections of the pre-tokenised pretraining kinds (frozen, validated), with NeMo AutoModel's key names.

`MegatronPretrainingSection` mirrors AutoModel's ``MegatronPretraining`` (Megatron ``.bin``/``.idx``
corpora); `NanogptSection` its ``NanogptDataset`` (nanoGPT ``.bin`` shards). Both give samples of
``seq_length + 1`` tokens read on demand; with ``packed_sequence.packed_sequence_size > 0``
positions restart after each EOS and attention stays inside each document (rows of that size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from automodel.data.errors import ConfigError

SPLIT_NAMES = ("train", "validation", "test")


def parse_split(split: object, *, key: str) -> list[float]:
    """``"969,30,1"`` -> [0.969, 0.03, 0.001] (missing parts are 0; weights normalised)."""
    if isinstance(split, list | tuple):
        split = ",".join(str(s) for s in split)
    if not isinstance(split, str):
        raise ConfigError(key, split, 'must be a string of ratios like "969,30,1" or "0.99, 0.01, 0.00"')
    parts = [p.strip() for p in split.split(",")]
    try:
        values = [float(p) for p in parts if p]
    except ValueError:
        raise ConfigError(key, split, 'must be comma-separated numbers like "969,30,1"') from None
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ConfigError(
            key, split, "must be 1 to 3 ratios >= 0 (train, validation, test) with a positive sum"
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def _positive_int(key: str, value: object, *, minimum: int = 1, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, f"must be an int >= {minimum}")


def _bool(key: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(key, value, "must be true or false")


def _zipped_blend(blend: object, *, key: str) -> list[str]:
    """``[{path: a, weight: 30}, {path: b, weight: 70}]`` -> Megatron's ``["30", "a", "70", "b"]``."""
    if not isinstance(blend, list) or not blend:
        raise ConfigError(key, blend, "must be a non-empty list of {path: ..., weight: ...}")
    out: list[str] = []
    for i, item in enumerate(blend):
        if not isinstance(item, dict) or set(item) != {"path", "weight"}:
            raise ConfigError(f"{key}[{i}]", item, "must be a mapping with exactly path and weight")
        w, path = item["weight"], item["path"]
        if isinstance(w, bool) or not isinstance(w, int | float) or not w > 0:
            raise ConfigError(f"{key}[{i}].weight", w, "blend weights must be numbers > 0")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{key}[{i}].path", path, "must be a corpus prefix")
        out += [str(w), path]
    return out


@dataclass(frozen=True)
class MegatronPretrainingSection:
    """Megatron indexed corpora (``paths``), split by document ratios, optionally blended by weight.

    Keys as in NeMo AutoModel's ``MegatronPretraining``; the samples are megatron-core's
    ``GPTDataset`` / ``BlendedDataset``'s, in their order (`megatron_order`, `blend_indices`).
    ``index_mapping_dir`` caches that order (built once, then memory-mapped); unset, it is
    ``<output_dir>/cache/megatron_index`` (`default_index_mapping_dir`: megatron-core also caches by
    default, beside the corpus, which may be read-only). ``num_dataset_builder_threads`` and ``mmap_bin_files`` are accepted so
    AutoModel's configs load: samples are always read from the ``.bin`` with positioned reads (a
    memory map's read-around would grow every rank's RSS with the samples read; the ``.idx`` is
    memory-mapped). ``tokenizer`` (AutoModel's per-dataset tokenizer) becomes the run's tokenizer
    when the YAML has no ``tokenizer:`` section naming one (a different one is an error).
    ``num_train_samples`` / ``num_val_samples`` / ``num_test_samples`` are megatron-core's sample
    counts (more passes over a corpus when it holds fewer; a weighted blend's size, default one pass
    over each corpus); ``seed`` is megatron-core's ``random_seed`` (default: the run's seed).
    """

    SECTION: ClassVar[str] = "dataset"
    DEFAULT_SPLIT: ClassVar[str] = "train"
    source: str = "megatron"
    #: prefixes, globs or a folder; a list (Megatron's zipped blend); a mapping per split; a .json file
    paths: str | list | dict | None = None
    # the same blend spelled as a list of {path, weight} (instead of paths' ["30", "a", "70", "b"])
    blend: list | None = None
    seq_length: int = 2048
    split: str | list = "900,50,50"
    splits_to_build: str | list | None = None
    index_mapping_dir: str | None = None
    tokenizer: dict | None = None
    seed: int | None = None
    num_train_samples: int | None = None
    num_val_samples: int | None = None
    num_test_samples: int | None = None
    num_dataset_builder_threads: int = 1
    mmap_bin_files: bool = True
    create_attention_mask: bool = False

    def __post_init__(self) -> None:
        s = self.SECTION
        if self.blend is not None:
            if self.paths is not None:
                raise ConfigError(f"{s}.blend", self.blend, "says what paths says; set only one of them")
            object.__setattr__(self, "paths", _zipped_blend(self.blend, key=f"{s}.blend"))
        if self.paths is None:
            raise ConfigError(f"{s}.paths", None, "is required (corpus prefixes, globs, a folder or a blend)")
        _positive_int(f"{s}.seq_length", self.seq_length, minimum=2)
        _positive_int(f"{s}.seed", self.seed, minimum=0, allow_none=True)
        for key in ("num_train_samples", "num_val_samples", "num_test_samples"):
            _positive_int(f"{s}.{key}", getattr(self, key), allow_none=True)
        _positive_int(f"{s}.num_dataset_builder_threads", self.num_dataset_builder_threads)
        _bool(f"{s}.mmap_bin_files", self.mmap_bin_files)
        if self.create_attention_mask is not False:
            raise ConfigError(
                f"{s}.create_attention_mask",
                self.create_attention_mask,
                "is not supported: documents are kept apart by packed_sequence (position ids), not masks",
            )

        parse_split(self.split, key=f"{s}.split")
        self.split_name  # noqa: B018 - validates splits_to_build

    @property
    def split_name(self) -> str:
        """The one split this section reads (``splits_to_build``, default train / validation)."""
        key, value = f"{self.SECTION}.splits_to_build", self.splits_to_build
        if value is None:
            return self.DEFAULT_SPLIT
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or len(names) != 1 or names[0] not in SPLIT_NAMES:
            raise ConfigError(key, value, "must name one split: train, validation or test")
        return names[0]

    @property
    def num_samples(self) -> int | None:
        return {
            "train": self.num_train_samples,
            "validation": self.num_val_samples,
            "test": self.num_test_samples,
        }[self.split_name]


@dataclass(frozen=True)
class MegatronPretrainingValidationSection(MegatronPretrainingSection):
    SECTION: ClassVar[str] = "validation_dataset"
    DEFAULT_SPLIT: ClassVar[str] = "validation"


@dataclass(frozen=True)
class NanogptSection:
    """nanoGPT ``.bin`` token shards (``file_pattern``: a glob, a file, or a list of them).

    Keys as in NeMo AutoModel's ``NanogptDataset``. Samples are consecutive windows of
    ``seq_len + 1`` tokens per shard (modded-nanogpt's stride). The order is the stored order, with
    the shards' order reshuffled every epoch when ``shuffle_files`` (from the run's seed);
    ``align_to_bos`` starts every window at a ``bos_token`` (one scan of the shards at start-up).
    """

    SECTION: ClassVar[str] = "dataset"
    SEQ_LENGTH_KEY: ClassVar[str] = "seq_len"  # AutoModel's spelling, named in errors
    source: str = "nanogpt"
    file_pattern: str | list | None = None
    seq_len: int = 1024
    bos_token: int | None = None
    shuffle_files: bool = False
    align_to_bos: bool = False

    def __post_init__(self) -> None:
        s = self.SECTION
        fp = self.file_pattern
        if (
            fp is None
            or fp == ""
            or fp == []
            or (isinstance(fp, list) and not all(isinstance(p, str) for p in fp))
        ):
            raise ConfigError(f"{s}.file_pattern", fp, "is required: a glob, a .bin file, or a list of them")
        _positive_int(f"{s}.seq_len", self.seq_len, minimum=2)
        _positive_int(f"{s}.bos_token", self.bos_token, minimum=0, allow_none=True)
        _bool(f"{s}.shuffle_files", self.shuffle_files)
        _bool(f"{s}.align_to_bos", self.align_to_bos)
        if self.align_to_bos and self.bos_token is None:
            raise ConfigError(f"{s}.bos_token", None, "is required when align_to_bos is true")

    @property
    def seq_length(self) -> int:
        return self.seq_len


@dataclass(frozen=True)
class NanogptValidationSection(NanogptSection):
    SECTION: ClassVar[str] = "validation_dataset"
