"""strategy: megatron_fsdp through the megatron-fsdp package (imported lazily; CUDA at run time).

``MegatronFSDPManager(config, mesh).parallelize(model, optimizer)`` applies TP, MLP activation
checkpointing and megatron-fsdp in that order; `microbatch_grad_sync`, `model_state_dict` and
`full_tensor` are what a training loop needs around the wrapped model. `build_fully_shard_call` is the pure translation
of `MegatronFSDPConfig` into megatron-fsdp's arguments.
"""

from automodel.megatron_fsdp._version import __version__ as __version__
from automodel.megatron_fsdp.checkpointing import apply_mlp_checkpointing
from automodel.megatron_fsdp.config import ZERO_DP_STRATEGIES, MegatronFSDPConfig, check_tensor_parallel
from automodel.megatron_fsdp.fully_shard import (
    MegatronFSDPConfigWarning,
    apply_megatron_fsdp,
    shard_optimizer,
)
from automodel.megatron_fsdp.layout import MegatronFSDPAxes, check_layout, megatron_fsdp_axes
from automodel.megatron_fsdp.manager import MegatronFSDPManager
from automodel.megatron_fsdp.optimizer import neutral_state_init, rebind_param_groups
from automodel.megatron_fsdp.runtime import MegatronFSDPUnavailableError, import_megatron_fsdp
from automodel.megatron_fsdp.training import (
    clip_grad_norm,
    full_tensor,
    is_megatron_fsdp,
    microbatch_grad_sync,
    model_state_dict,
    parameter_buffers,
    prepare_state_dict_for_dcp,
)
from automodel.megatron_fsdp.translate import FIELD_DESTINATIONS, FullyShardCall, build_fully_shard_call
from automodel.megatron_fsdp.units import resolve_unit_modules

__all__ = [
    "FIELD_DESTINATIONS",
    "ZERO_DP_STRATEGIES",
    "FullyShardCall",
    "MegatronFSDPAxes",
    "MegatronFSDPConfig",
    "MegatronFSDPConfigWarning",
    "MegatronFSDPManager",
    "MegatronFSDPUnavailableError",
    "apply_megatron_fsdp",
    "apply_mlp_checkpointing",
    "build_fully_shard_call",
    "check_layout",
    "check_tensor_parallel",
    "clip_grad_norm",
    "full_tensor",
    "is_megatron_fsdp",
    "microbatch_grad_sync",
    "model_state_dict",
    "prepare_state_dict_for_dcp",
    "import_megatron_fsdp",
    "megatron_fsdp_axes",
    "neutral_state_init",
    "parameter_buffers",
    "rebind_param_groups",
    "resolve_unit_modules",
    "shard_optimizer",
]
