"""automodel.data: Megatron ``.bin/.idx`` corpora read sample for sample-core does,
weighted blends, nanoGPT shards, HF streaming, SFT rows and packing, and `preprocess`; a stateful
loader per dp rank whose position resumes on any number of ranks. Depends on torch and numpy;
transformers / pyarrow / datasets are extras (``automodel-data[hf,arrow,datasets]``), imported
on first use.

`build_dataset(section, tokenizer=...)` and `build_loader(dataset, ...)` (`automodel.data.api`) are
the entry points for a plain torch loop; the sections are frozen dataclasses validated on creation. The names here are imported on first
use, so importing a section module (`automodel.data.pretrain_sections`, ...) loads no builder.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from automodel.data._version import __version__ as __version__

if TYPE_CHECKING:  # the names below, imported on first use: a section module imports no builder
    from automodel.data.api import (
        Vocab,
        Vocabulary,
        build_dataset,
        build_loader,
    )
    from automodel.data.batches import (
        Batch,
        BatchLoader,
        build_sampler,
    )
    from automodel.data.errors import (
        ConfigError,
        DataError,
        MissingExtraError,
    )
    from automodel.data.megatron_writer import MegatronWriter
    from automodel.data.packing import PackedDataset, pack_documents
    from automodel.data.pretrain_sections import (
        MegatronPretrainingSection,
        MegatronPretrainingValidationSection,
        NanogptSection,
        NanogptValidationSection,
    )
    from automodel.data.sampler import StatefulGlobalBatchSampler
    from automodel.data.sections import DataSection
    from automodel.data.streaming_section import (
        StreamingSection,
        StreamingValidationSection,
    )
    from automodel.data.text_sections import (
        DatasetSection,
        SFTDatasetSection,
        SFTValidationDatasetSection,
        ValidationDatasetSection,
    )
    from automodel.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

_API = {
    "DatasetSection": "automodel.data.text_sections",
    "SFTDatasetSection": "automodel.data.text_sections",
    "SFTValidationDatasetSection": "automodel.data.text_sections",
    "ValidationDatasetSection": "automodel.data.text_sections",
    "ByteTokenizer": "automodel.data.tokenizer",
    "HFTokenizer": "automodel.data.tokenizer",
    "build_tokenizer": "automodel.data.tokenizer",
    "Batch": "automodel.data.batches",
    "BatchLoader": "automodel.data.batches",
    "ConfigError": "automodel.data.errors",
    "DataError": "automodel.data.errors",
    "MegatronPretrainingSection": "automodel.data.pretrain_sections",
    "MegatronPretrainingValidationSection": "automodel.data.pretrain_sections",
    "MegatronWriter": "automodel.data.megatron_writer",
    "MissingExtraError": "automodel.data.errors",
    "NanogptSection": "automodel.data.pretrain_sections",
    "NanogptValidationSection": "automodel.data.pretrain_sections",
    "PackedDataset": "automodel.data.packing",
    "DataSection": "automodel.data.sections",
    "StatefulGlobalBatchSampler": "automodel.data.sampler",
    "StreamingSection": "automodel.data.streaming_section",
    "StreamingValidationSection": "automodel.data.streaming_section",
    "Vocab": "automodel.data.api",
    "Vocabulary": "automodel.data.api",
    "build_dataset": "automodel.data.api",
    "build_loader": "automodel.data.api",
    "build_sampler": "automodel.data.batches",
    "pack_documents": "automodel.data.packing",
}
__all__ = [
    "ByteTokenizer",
    "DatasetSection",
    "HFTokenizer",
    "SFTDatasetSection",
    "SFTValidationDatasetSection",
    "ValidationDatasetSection",
    "build_tokenizer",
    "Batch",
    "BatchLoader",
    "ConfigError",
    "DataError",
    "MegatronPretrainingSection",
    "MegatronPretrainingValidationSection",
    "MegatronWriter",
    "MissingExtraError",
    "NanogptSection",
    "NanogptValidationSection",
    "PackedDataset",
    "DataSection",
    "StatefulGlobalBatchSampler",
    "StreamingSection",
    "StreamingValidationSection",
    "Vocab",
    "Vocabulary",
    "build_dataset",
    "build_loader",
    "build_sampler",
    "pack_documents",
]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'automodel.data' has no attribute {name!r}")
    return getattr(import_module(_API[name]), name)
