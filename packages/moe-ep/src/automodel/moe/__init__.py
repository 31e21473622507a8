"""automodel.moe: expert parallelism for Hugging Face mixture-of-experts models (FSDP2 and activation
checkpointing are automodel.fsdp2's, composed by automodel.recipes)."""

from automodel.moe._version import __version__ as __version__
from automodel.moe.config import MoEParallelizerConfig
from automodel.moe.dispatch import DispatchPlan, combine_tokens, dispatch_tokens, plan_dispatch
from automodel.moe.expert_parallel import ExpertParallelExperts, apply_ep
from automodel.moe.grouped_gemm import grouped_expert_mlp, grouped_mm_supported
from automodel.moe.load import ExpertLoad
from automodel.moe.model_inspect import (
    ExpertsLayout,
    MoEBlock,
    check_expert_parallel_support,
    find_moe_blocks,
)
from automodel.moe.parallelizer import ExpertShardUnit, parallelize_experts, validate_moe_layout

__all__ = [
    "DispatchPlan",
    "ExpertLoad",
    "ExpertParallelExperts",
    "ExpertShardUnit",
    "ExpertsLayout",
    "MoEBlock",
    "MoEParallelizerConfig",
    "apply_ep",
    "check_expert_parallel_support",
    "combine_tokens",
    "dispatch_tokens",
    "find_moe_blocks",
    "grouped_expert_mlp",
    "grouped_mm_supported",
    "parallelize_experts",
    "plan_dispatch",
    "validate_moe_layout",
]
