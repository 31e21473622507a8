"""MegatronFSDPConfig -> the exact arguments megatron-fsdp's `fully_shard_model` receives.

A pure function (no process group, no CUDA), so every field's destination is testable on CPU.
Where each field goes (megatron-fsdp 0.6.1):

==========================  ======================================================================
field                       destination
==========================  ======================================================================
zero_dp_strategy            ``zero_dp_strategy`` = no_shard / optim / optim_grads / optim_grads_params
                            (-> DDP config ``data_parallel_sharding_strategy``)
init_fsdp_with_meta_device  ``init_model_with_meta_device``
grad_reduce_in_fp32         ``MixedPrecisionPolicy.main_grads_dtype`` = float32 (else None: param dtype)
preserve_fp32_weights       ``MixedPrecisionPolicy.main_params_dtype`` = float32 (else None: no fp32 copy)
overlap_grad_reduce         ``overlap_grad_reduce``
overlap_param_gather        ``overlap_param_gather``
check_for_nan_in_grad       DDP config ``check_for_nan_in_grad`` (set on ``MegatronFSDP.ddp_config``;
                            `fully_shard` has no argument for it). megatron-fsdp checks only on its
                            synchronous reduce path: with overlap_grad_reduce=True a warning says so
average_in_collective       ``average_in_collective``
disable_bucketing           ``disable_bucketing``
calculate_per_token_loss    ``calculate_per_token_loss`` (True = SUM over the dp group; also set by
                            ``gradient_divide_factor=1.0``)
keep_fp8_transpose_cache    ``keep_fp8_transpose_cache``
nccl_ub                     ``nccl_ub`` (megatron-fsdp forces double buffers on: warned)
fsdp_double_buffer          ``fsdp_double_buffer``
megatron_fsdp_unit_modules  ``fsdp_unit_modules`` (classes; default: the model's ``_no_split_modules``)
sequence_parallel           rejected in MegatronFSDPConfig (ValueError)
tp_plan                     the TP plan applied before megatron-fsdp (``apply_tp``)
activation_checkpointing    checkpoint_wrapper around each decoder layer's MLP (``apply_mlp_checkpointing``)
backend                     not a megatron-fsdp argument: the process-group backend the recipe
                            initialises (megatron-fsdp needs CUDA, so ``nccl`` in practice)
==========================  ======================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from automodel.megatron_fsdp.config import MegatronFSDPConfig

#: Where each MegatronFSDPConfig field goes (documentation table above, in data form).
FIELD_DESTINATIONS: dict[str, str] = {
    "zero_dp_strategy": "fully_shard_model(zero_dp_strategy=...)",
    "init_fsdp_with_meta_device": "fully_shard_model(init_model_with_meta_device=...)",
    "grad_reduce_in_fp32": "MixedPrecisionPolicy(main_grads_dtype=...)",
    "preserve_fp32_weights": "MixedPrecisionPolicy(main_params_dtype=...)",
    "overlap_grad_reduce": "fully_shard_model(overlap_grad_reduce=...)",
    "overlap_param_gather": "fully_shard_model(overlap_param_gather=...)",
    "check_for_nan_in_grad": "MegatronFSDP.ddp_config.check_for_nan_in_grad",
    "average_in_collective": "fully_shard_model(average_in_collective=...)",
    "disable_bucketing": "fully_shard_model(disable_bucketing=...)",
    "calculate_per_token_loss": "fully_shard_model(calculate_per_token_loss=...)",
    "keep_fp8_transpose_cache": "fully_shard_model(keep_fp8_transpose_cache=...)",
    "nccl_ub": "fully_shard_model(nccl_ub=...)",
    "fsdp_double_buffer": "fully_shard_model(fsdp_double_buffer=...)",
    "megatron_fsdp_unit_modules": "fully_shard_model(fsdp_unit_modules=...)",
    "sequence_parallel": "rejected (ValueError) when True",
    "tp_plan": "apply_tp (before megatron-fsdp)",
    "activation_checkpointing": "apply_mlp_checkpointing (before megatron-fsdp)",
    "backend": "process-group backend (recipes' init_distributed)",
}


@dataclass(frozen=True)
class FullyShardCall:
    """Everything megatron-fsdp receives, except the model, mesh object and device."""

    kwargs: dict[str, Any]
    mixed_precision: dict[str, torch.dtype | None]
    ddp_config_overrides: dict[str, Any]
    warnings: tuple[str, ...] = field(default=())

    def fully_shard_model_kwargs(self) -> dict[str, Any]:
        """`kwargs` plus the real ``megatron_fsdp.MixedPrecisionPolicy`` (imports megatron-fsdp)."""
        # lazy: optional dependency (megatron-fsdp, CUDA only)
        from megatron_fsdp import MixedPrecisionPolicy

        return {**self.kwargs, "mixed_precision_policy": MixedPrecisionPolicy(**self.mixed_precision)}


def build_fully_shard_call(
    config: MegatronFSDPConfig,
    *,
    dp_shard_dim: str,
    tp_dim: str,
    unit_modules: list[type[nn.Module]],
    dp_group_size: int,
    gradient_divide_factor: float | None = None,
) -> FullyShardCall:
    """Translate `config` for a shard group of `dp_group_size` ranks named `dp_shard_dim`.

    `gradient_divide_factor` follows the workspace convention: None keeps megatron-fsdp's
    averaging (or the config's `calculate_per_token_loss`), 1.0 sums (the recipes normalise the
    loss by the global token count). megatron-fsdp can only sum or divide by its group size, so
    any other factor is a ValueError.
    """
    per_token = _resolve_sum_mode(config, gradient_divide_factor, dp_group_size)
    notes: list[str] = []
    double_buffer = config.fsdp_double_buffer
    if config.nccl_ub and not double_buffer:
        double_buffer = True
        notes.append(
            "nccl_ub=True needs persistent double buffers: megatron-fsdp turns fsdp_double_buffer on "
            "(passed as fsdp_double_buffer=True)"
        )
    if config.check_for_nan_in_grad and config.overlap_grad_reduce:
        notes.append(
            "check_for_nan_in_grad=True: megatron-fsdp 0.6.1 checks gradients for NaN/Inf only on its "
            "synchronous reduce path; with overlap_grad_reduce=True the overlapped reduce-scatter is not "
            "checked (set overlap_grad_reduce=False to enforce the check, or rely on the recipe's grad-norm check)"
        )
    kwargs: dict[str, Any] = {
        "dp_shard_dim": dp_shard_dim,
        "tp_dim": tp_dim,
        "fsdp_unit_modules": list(unit_modules),
        "zero_dp_strategy": config.data_parallel_sharding_strategy,
        "init_model_with_meta_device": config.init_fsdp_with_meta_device,
        "overlap_grad_reduce": config.overlap_grad_reduce,
        "overlap_param_gather": config.overlap_param_gather,
        "average_in_collective": config.average_in_collective,
        "disable_bucketing": config.disable_bucketing,
        "calculate_per_token_loss": per_token,
        "keep_fp8_transpose_cache": config.keep_fp8_transpose_cache,
        "nccl_ub": config.nccl_ub,
        "fsdp_double_buffer": double_buffer,
        "sync_model_each_microbatch": True,
        "preproc_state_dict_for_dcp_ckpt": True,
    }
    mixed_precision = {
        "main_params_dtype": torch.float32 if config.preserve_fp32_weights else None,
        "main_grads_dtype": torch.float32 if config.grad_reduce_in_fp32 else None,
        "grad_comm_dtype": None,
    }
    overrides = {"check_for_nan_in_grad": config.check_for_nan_in_grad}
    return FullyShardCall(
        kwargs=kwargs, mixed_precision=mixed_precision, ddp_config_overrides=overrides, warnings=tuple(notes)
    )


def _resolve_sum_mode(config: MegatronFSDPConfig, factor: float | None, dp_group_size: int) -> bool:
    """True when gradients must be summed over the dp group (megatron's calculate_per_token_loss)."""
    if factor is None:
        return config.calculate_per_token_loss
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
        raise ValueError(f"gradient_divide_factor must be a positive number or None, got {factor!r}")
    if math.isclose(factor, 1.0):
        if config.average_in_collective:
            raise ValueError(
                "gradient_divide_factor=1.0 asks for summed gradients, but average_in_collective=True "
                "averages them; set average_in_collective=False"
            )
        return True
    if math.isclose(factor, dp_group_size):
        if config.calculate_per_token_loss:
            raise ValueError(
                f"gradient_divide_factor={factor} asks for averaged gradients, but "
                "calculate_per_token_loss=True sums them; set one of them consistently"
            )
        return False
    raise ValueError(
        f"gradient_divide_factor={factor} is not supported by megatron-fsdp: it can sum (1.0) or "
        f"average over its data-parallel group (None or {dp_group_size})"
    )
