"""The tensor-parallel style vocabulary: Hugging Face plan strings -> torch ``ParallelStyle`` objects.

Which HF styles have a DTensor equivalent (and what they become), which are known but belong to
another package or mode (refused with the reason), and which styles only re-lay activations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from automodel.fsdp2.tp_shared_styles import RowwiseOwnedOutput

#: Module FQN (or fnmatch pattern, atom by atom) -> the style that lays it out.
TPPlan = dict[str, ParallelStyle]


#: HF styles with a DTensor equivalent, and what they become.
_STYLE_FACTORIES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    # Rowwise outputs stay ordinary tensors: some models update them in place (RowwiseOwnedOutput).
    "rowwise": RowwiseOwnedOutput,
    "local_colwise": ColwiseParallel,
    "local_rowwise": RowwiseOwnedOutput,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
    # A replicated module fed head-sharded activations (e.g. Qwen3 q_norm/k_norm after a colwise
    # q_proj): its weight grad is a partial sum over TP ranks, which DTensor all-reduces.
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True),
}


#: HF styles we know but do not translate: expert/packed/EP styles belong to automodel.moe.
_UNSUPPORTED_STYLES = {
    "packed_colwise": "packed (fused) projections need a strided shard; give an explicit plan",
    "packed_rowwise": "packed (fused) projections need a strided shard; give an explicit plan",
    "local_packed_rowwise": "packed (fused) projections need a strided shard; give an explicit plan",
    "moe_tp_experts": "MoE experts are parallelized by automodel.moe (EP)",
    "moe_identity_expert": "MoE experts are parallelized by automodel.moe (EP)",
    "grouped_gemm": "an expert-parallel (EP) style; use automodel.moe",
    "ep_dispatch_experts": "an expert-parallel (EP) style; use automodel.moe",
    "mla_kv_a_proj": "needs the rope width of the model; a model's own HF plan resolves it",
    "all_reduce": "a module-output all-reduce of HF's own TP engine",
    "local_params": "HF's manual local-parameter mode",
    "local": "HF's manual local-tensor mode",
    "replicate": "HF's replicate marker (nothing to shard)",
}


#: Styles that `get_hf_tp_shard_plan` leaves out (the module stays replicated: correct, not sharded).
SKIPPED_IN_HF_PLAN = set(_UNSUPPORTED_STYLES) - {"mla_kv_a_proj"}


#: Styles that only re-lay activations and leave a module's parameters alone.
LAYOUT_ONLY_STYLES = (PrepareModuleInput, PrepareModuleOutput)


def translate_to_torch_parallel_style(style: str) -> ParallelStyle:
    """Translate one HF plan string (``"colwise"``, ``"embedding_rowwise"``, ...) to a torch style."""
    if not isinstance(style, str):
        raise ValueError(f"tensor-parallel style must be a string, got {style!r}")
    factory = _STYLE_FACTORIES.get(style)
    if factory is not None:
        return factory()
    if style in _UNSUPPORTED_STYLES:
        raise ValueError(
            f"tensor-parallel style {style!r} is not supported by automodel.fsdp2: {_UNSUPPORTED_STYLES[style]}"
        )
    raise ValueError(
        f"unknown tensor-parallel style {style!r}; known styles: {', '.join(sorted(_STYLE_FACTORIES))}"
    )


def plan_has_sequence_parallel(plan: Mapping[str, ParallelStyle]) -> bool:
    """True when some style shards activations along the sequence (then position ids must be explicit)."""
    return any(type(s) is SequenceParallel and s.sequence_sharding[0] == Shard(1) for s in plan.values())
