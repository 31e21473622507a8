"""FSDP2/HSDP, tensor and sequence parallel, activation checkpointing and DDP for Hugging Face models.

The names here are the public API (configs, managers, appliers, meta-device init, TP plans);
helpers the appliers share live in their submodules (``tp_plan``, ``meta_init``, ``fsdp``, ...).
"""

from automodel.fsdp2._version import __version__ as __version__
from automodel.fsdp2.activation_checkpointing import apply_activation_checkpointing, get_lm_ac_layers
from automodel.fsdp2.autocast import apply_autocast
from automodel.fsdp2.compile import apply_compile
from automodel.fsdp2.config import DDPConfig, FSDP2Config, TensorParallelConfig, default_mp_policy
from automodel.fsdp2.ddp import DDPManager, apply_ddp
from automodel.fsdp2.fsdp import (
    SubmoduleSharding,
    apply_fsdp2_sharding_recursively,
    set_gradient_divide_factor,
    unshard_fsdp2_model,
)
from automodel.fsdp2.grad_sync import grad_sync_context, set_gradient_sync
from automodel.fsdp2.meta_init import default_init_fn, materialize_meta_model
from automodel.fsdp2.parallelize import (
    FSDP2Manager,
    apply_sharding_from_config,
    apply_tensor_parallel_from_config,
    fsdp2_strategy_parallelize,
)
from automodel.fsdp2.prefetch import apply_fsdp2_prefetch
from automodel.fsdp2.tensor_parallel import apply_tp
from automodel.fsdp2.tp_plan import (
    get_hf_tp_shard_plan,
    resolve_tp_plan,
    translate_to_torch_parallel_style,
    validate_tp_mesh,
)
from automodel.fsdp2.utils import import_class_from_path, import_classes_from_paths

__all__ = [
    "DDPConfig",
    "DDPManager",
    "FSDP2Config",
    "FSDP2Manager",
    "SubmoduleSharding",
    "TensorParallelConfig",
    "apply_activation_checkpointing",
    "apply_autocast",
    "apply_compile",
    "apply_ddp",
    "apply_fsdp2_prefetch",
    "apply_fsdp2_sharding_recursively",
    "apply_sharding_from_config",
    "apply_tensor_parallel_from_config",
    "apply_tp",
    "default_init_fn",
    "default_mp_policy",
    "fsdp2_strategy_parallelize",
    "get_hf_tp_shard_plan",
    "get_lm_ac_layers",
    "grad_sync_context",
    "import_class_from_path",
    "import_classes_from_paths",
    "materialize_meta_model",
    "resolve_tp_plan",
    "set_gradient_divide_factor",
    "set_gradient_sync",
    "translate_to_torch_parallel_style",
    "unshard_fsdp2_model",
    "validate_tp_mesh",
]
