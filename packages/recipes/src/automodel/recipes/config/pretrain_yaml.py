"""What the recipes add to the data package's pretraining sections when a YAML is read: the default
cache folder of a Megatron order under the run's output_dir, and AutoModel's per-dataset tokenizer
adopted as the run's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import PurePath
from typing import TypeVar

from automodel.data.pretrain_sections import MegatronPretrainingSection
from automodel.recipes.config.build import derived
from automodel.recipes.config.recipe import DatasetConfig
from automodel.recipes.config.sections import TokenizerSection
from automodel.recipes.errors import ConfigError

S = TypeVar("S")


#: Where a Megatron dataset's sample order is cached when ``index_mapping_dir`` is unset.
DEFAULT_INDEX_MAPPING_SUBDIR = ("cache", "megatron_index")


def default_index_mapping_dir(section: S, *, output_dir: str) -> S:
    """A Megatron section without ``index_mapping_dir`` caches its order under the run's output_dir,
    so a restart (or another rank) maps it instead of building it: that build is linear in the
    corpus' documents, a memory map of it is not. Returns the section to use (a new value)."""
    if isinstance(section, MegatronPretrainingSection) and section.index_mapping_dir is None:
        return derived(section, index_mapping_dir=str(PurePath(output_dir, *DEFAULT_INDEX_MAPPING_SUBDIR)))
    return section


def adopt_dataset_tokenizer(
    tokenizer: TokenizerSection, sections: list[DatasetConfig | None]
) -> TokenizerSection:
    """NeMo AutoModel names a Megatron dataset's tokenizer inside the dataset section. Its
    ``pretrained_model_name_or_path`` becomes the run's tokenizer when ``tokenizer:`` names none;
    two different tokenizers cannot both hold (the tokens would not match the model's embedding).
    Returns the run's tokenizer section (a new value when adopted)."""
    for section in sections:
        spec: dict | None = getattr(section, "tokenizer", None)  # the kinds with a per-dataset tokenizer
        if spec is None:
            continue
        key = f"{section.SECTION}.tokenizer"
        name = spec.get("pretrained_model_name_or_path")
        if not isinstance(name, str) or not name:
            raise ConfigError(
                f"{key}.pretrained_model_name_or_path", name, "is required (a local directory or a Hub id)"
            )
        current = tokenizer.pretrained_model_name_or_path or tokenizer.path
        if current is None:
            tokenizer = replace(tokenizer, pretrained_model_name_or_path=name)
        elif current != name:
            raise ConfigError(key, name, f"differs from the run's tokenizer {current!r}; use one tokenizer")
    return tokenizer
