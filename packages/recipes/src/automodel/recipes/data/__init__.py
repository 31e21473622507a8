"""Data without downloads: embedded corpus, byte tokenizer, local files, packing, stateful sampler."""

from automodel.data.corpus import embedded_documents
from automodel.recipes.data.loader import Batch, BatchLoader, build_packed_dataset
from automodel.data.packing import PackedDataset, pack_documents
from automodel.data.sampler import StatefulGlobalBatchSampler
from automodel.data.tokenizer import ByteTokenizer, build_tokenizer

__all__ = [
    "Batch",
    "BatchLoader",
    "ByteTokenizer",
    "PackedDataset",
    "StatefulGlobalBatchSampler",
    "build_packed_dataset",
    "build_tokenizer",
    "embedded_documents",
    "pack_documents",
]
