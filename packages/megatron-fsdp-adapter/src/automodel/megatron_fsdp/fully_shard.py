"""`apply_megatron_fsdp`: wrap a (TP-sharded) model in megatron-fsdp over the mesh's dp axis."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn

from automodel.megatron_fsdp.config import MegatronFSDPConfig
from automodel.megatron_fsdp.layout import megatron_fsdp_axes
from automodel.megatron_fsdp.optimizer import neutral_state_init, rebind_param_groups
from automodel.megatron_fsdp.runtime import import_megatron_fsdp
from automodel.megatron_fsdp.translate import build_fully_shard_call
from automodel.mesh import MeshContext


class MegatronFSDPConfigWarning(UserWarning):
    """A MegatronFSDPConfig setting that megatron-fsdp honours only in part (see translate.py)."""


def apply_megatron_fsdp(
    model: nn.Module,
    *,
    mesh: MeshContext,
    config: MegatronFSDPConfig,
    unit_modules: list[type[nn.Module]],
    optimizer: torch.optim.Optimizer | None = None,
    gradient_divide_factor: float | None = None,
    optimizer_param_names: Mapping[int, str] | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Shard `model` (and `optimizer`, if given) with megatron-fsdp; needs CUDA.

    `optimizer_param_names` maps ``id`` of each parameter the optimizer holds to its FQN, when the
    optimizer was built before earlier steps (TP) replaced the model's parameters.

    Returns the ``MegatronFSDP`` wrapper (the original module is ``.module``) and the optimizer,
    now stepping the distributed parameters. Without an optimizer, build one later on
    ``model.parameters()`` and pass it through `shard_optimizer`.
    """
    axes = megatron_fsdp_axes(mesh)
    megatron_fsdp = import_megatron_fsdp()
    call = build_fully_shard_call(
        config,
        dp_shard_dim=axes.dp_shard_dim,
        tp_dim=axes.tp_dim,
        unit_modules=unit_modules,
        dp_group_size=axes.dp_group_size,
        gradient_divide_factor=gradient_divide_factor,
    )
    for note in call.warnings:
        warnings.warn(note, MegatronFSDPConfigWarning, stacklevel=2)
    old_names = dict(optimizer_param_names or {id(p): name for name, p in model.named_parameters()})
    wrapped = megatron_fsdp.fully_shard_model(
        module=model,
        device_mesh=mesh.device_mesh,
        device=torch.device("cuda", torch.cuda.current_device()),
        **call.fully_shard_model_kwargs(),
    )
    for key, value in call.ddp_config_overrides.items():
        assert hasattr(wrapped.ddp_config, key), f"megatron-fsdp DDP config has no {key}"
        setattr(wrapped.ddp_config, key, value)
    wrapped._replace_param_with_distributed_if_needed()
    if optimizer is not None:
        rebind_param_groups(
            optimizer, old_names=old_names, new_params=dict(wrapped.module.named_parameters())
        )
        optimizer = shard_optimizer(optimizer, model=wrapped)
    return wrapped, optimizer


def shard_optimizer(
    optimizer: torch.optim.Optimizer, *, model: nn.Module | None = None
) -> torch.optim.Optimizer:
    """Make an optimizer built on a MegatronFSDP model's parameters drive megatron-fsdp.

    Patches ``step``/``zero_grad`` (gradient sync, weight install, buffer zeroing) in place; the
    eager state creation megatron-fsdp does here changes no parameter (`neutral_state_init`).
    With `model` (the ``MegatronFSDP`` wrapper), its distributed parameters are installed first
    and each carries the back-reference megatron-fsdp finds the model by.
    """
    megatron_fsdp = import_megatron_fsdp()
    if model is not None:
        model._replace_param_with_distributed_if_needed()  # pyright: ignore[reportCallIssue]  # megatron-fsdp's method
        for param in model.get_submodule("module").parameters():
            setattr(param, "_megatron_fsdp_model", model)  # noqa: B010 - megatron-fsdp's back-reference
    with neutral_state_init(optimizer):
        return megatron_fsdp.fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt=True)
