"""The recipes' side of the data layer (which lives in automodel-data, `automodel.data`): the dataset
kinds a YAML section selects (`kinds`) and the pre-launch checks that need the model (`launch_data`).
The names below are re-exported for the recipes' callers."""

from automodel.data.corpus import embedded_documents
from automodel.data.packing import PackedDataset, pack_documents
from automodel.data.sampler import StatefulGlobalBatchSampler
from automodel.data.tokenizer import ByteTokenizer, build_tokenizer
from automodel.recipes.data.kinds import build_packed_dataset

__all__ = [
    "ByteTokenizer",
    "PackedDataset",
    "StatefulGlobalBatchSampler",
    "build_packed_dataset",
    "build_tokenizer",
    "embedded_documents",
    "pack_documents",
]
