"""automodel.moe: expert parallelism (EP x FSDP2) for Hugging Face mixture-of-experts models."""

from automodel.moe._version import __version__ as __version__
from automodel.moe.checkpointing import apply_ac, checkpoint_module
from automodel.moe.config import MoEParallelizerConfig
from automodel.moe.dispatch import DispatchPlan, combine_tokens, dispatch_tokens, plan_dispatch
from automodel.moe.expert_parallel import ExpertParallelExperts, apply_ep
from automodel.moe.fsdp import apply_fsdp
from automodel.moe.grouped_gemm import grouped_expert_mlp, grouped_mm_supported
from automodel.moe.load import ExpertLoad
from automodel.moe.model_inspect import (
    ExpertsLayout,
    MoEBlock,
    check_expert_parallel_support,
    find_moe_blocks,
)
from automodel.moe.parallelizer import dense_fsdp_mesh, parallelize_model, validate_moe_layout

__all__ = [
    "DispatchPlan",
    "ExpertLoad",
    "ExpertParallelExperts",
    "ExpertsLayout",
    "MoEBlock",
    "MoEParallelizerConfig",
    "apply_ac",
    "apply_ep",
    "apply_fsdp",
    "check_expert_parallel_support",
    "checkpoint_module",
    "combine_tokens",
    "dense_fsdp_mesh",
    "dispatch_tokens",
    "find_moe_blocks",
    "grouped_expert_mlp",
    "grouped_mm_supported",
    "parallelize_model",
    "plan_dispatch",
    "validate_moe_layout",
]
