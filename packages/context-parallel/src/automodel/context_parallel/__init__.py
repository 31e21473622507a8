"""Context parallelism: CP batch sharding, ring attention on any device, torch SDPA CP and Transformer Engine THD."""

from automodel.context_parallel._version import __version__ as __version__
from automodel.context_parallel.backends import BACKENDS, resolve_backend
from automodel.context_parallel.batch import make_cp_batch_and_ctx
from automodel.context_parallel.hf_attention import (
    ATTN_IMPLEMENTATION,
    apply_context_parallel,
    attach_context_parallel_hooks,
    check_context_parallel_support,
    context_parallel_attention,
    context_parallel_modules,
)
from automodel.context_parallel.layout import (
    contiguous_indices,
    load_balanced_indices,
    shard_sequence,
    unshard_sequence,
)
from automodel.context_parallel.ring_attention import KV_ROTATIONS, ring_attention
from automodel.context_parallel.te_batch import make_cp_batch_for_te
from automodel.context_parallel.thd import document_ids, pad_documents, thd_partitioned_indices

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BACKENDS",
    "KV_ROTATIONS",
    "apply_context_parallel",
    "attach_context_parallel_hooks",
    "check_context_parallel_support",
    "context_parallel_attention",
    "context_parallel_modules",
    "contiguous_indices",
    "document_ids",
    "load_balanced_indices",
    "make_cp_batch_and_ctx",
    "make_cp_batch_for_te",
    "pad_documents",
    "resolve_backend",
    "ring_attention",
    "shard_sequence",
    "thd_partitioned_indices",
    "unshard_sequence",
]
