"""automodel.data: Megatron ``.bin/.idx`` corpora read sample for sample as megatron-core does,
weighted blends, nanoGPT shards, HF streaming, SFT rows and packing, and `preprocess`; a stateful
loader per dp rank whose position resumes on any number of ranks. Depends on torch and numpy;
transformers / pyarrow / datasets are extras (``automodel-data[hf,arrow,datasets]``), imported
on first use.

`build_dataset(section, tokenizer=...)` and `build_loader(dataset, ...)` (`automodel.data.api`) are
the entry points for a plain torch loop; the sections are frozen dataclasses validated on creation.
"""

from automodel.data._version import __version__ as __version__
from automodel.data.api import PretrainSection, Vocab, Vocabulary, build_dataset, build_loader
from automodel.data.batches import Batch, BatchLoader, build_sampler
from automodel.data.errors import ConfigError, DataError, MissingExtraError
from automodel.data.megatron_writer import MegatronWriter
from automodel.data.packing import PackedDataset, pack_documents
from automodel.data.pretrain_sections import (
    MegatronPretrainingSection,
    MegatronPretrainingValidationSection,
    NanogptSection,
    NanogptValidationSection,
)
from automodel.data.sampler import StatefulGlobalBatchSampler
from automodel.data.streaming_section import StreamingSection, StreamingValidationSection

__all__ = [
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
    "PretrainSection",
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
