"""The FSDP2 strategy's appliers composed in their fixed order, in two halves.

Order: TP/SP -> [CP hooks, EP's expert sharding: other packages, composed by the recipes] -> activation
checkpointing -> per-layer compile -> FSDP2 (layers, then root) -> prefetch chains -> autocast.
`apply_tensor_parallel_from_config` is the first half and `apply_sharding_from_config` the second;
`fsdp2_strategy_parallelize` runs both back to back, and a composer that adds CP or EP runs them
around its own steps, so the order lives here only. Dense and MoE models take the same second half: a composer that
made experts expert parallel names them in ``submodules`` (each an FSDP2 unit over its own mesh)
and asks the checkpointing to replay the routers' decisions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from automodel.fsdp2.activation_checkpointing import apply_activation_checkpointing
from automodel.fsdp2.autocast import apply_autocast
from automodel.fsdp2.compile import apply_compile
from automodel.fsdp2.config import FSDP2Config, TensorParallelConfig
from automodel.fsdp2.fsdp import SubmoduleSharding, apply_fsdp2_sharding_recursively
from automodel.fsdp2.grad_sync import grad_sync_context
from automodel.fsdp2.packed_sequence import patch_is_packed_sequence
from automodel.fsdp2.prefetch import apply_fsdp2_prefetch
from automodel.fsdp2.tensor_parallel import apply_tp, enable_async_tp
from automodel.mesh import MeshContext


def apply_tensor_parallel_from_config(
    model: nn.Module,
    *,
    mesh: MeshContext,
    config: FSDP2Config,
    tp_plan: Mapping[str, Any] | str | None = None,
    sequence_parallel: bool | None = None,
    tensor_parallel: TensorParallelConfig | None = None,
) -> None:
    """First half: packed-sequence patch, then TP/SP over the ``tp`` axis (a no-op when tp is 1).

    The TP options are `tensor_parallel` when given (a composer that owns them apart from the
    strategy's flags), else `config`'s TP fields; `tp_plan` / `sequence_parallel` override either."""
    tp = config.tensor_parallel if tensor_parallel is None else tensor_parallel
    sequence_parallel = tp.sequence_parallel if sequence_parallel is None else sequence_parallel
    tp_plan = tp.tp_plan if tp_plan is None else tp_plan
    if config.patch_is_packed_sequence:
        patch_is_packed_sequence()
    tp_mesh = mesh.get_optional_mesh("tp")
    if tp_mesh is not None:
        apply_tp(model, tp_mesh=tp_mesh, tp_plan=tp_plan, sequence_parallel=sequence_parallel)
        if tp.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)


def apply_sharding_from_config(
    model: nn.Module,
    *,
    mesh: MeshContext,
    config: FSDP2Config,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    activation_checkpointing: bool | None = None,
    gradient_divide_factor: float | None = None,
    pp_enabled: bool | None = None,
    compile_backend: str = "inductor",
    submodules: Sequence[SubmoduleSharding] = (),
    save_router_decisions: bool = False,
    reshard_after_forward: bool | None = None,
    wrap_root: bool = True,
) -> None:
    """Second half: activation checkpointing -> compile -> FSDP2 -> prefetch -> autocast.

    `submodules`, `reshard_after_forward` and `wrap_root` go to `apply_fsdp2_sharding_recursively`
    (expert-parallel experts over their own mesh); `save_router_decisions` to the checkpointing.
    """
    activation_checkpointing = (
        config.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    )
    if activation_checkpointing:
        apply_activation_checkpointing(model, save_router_decisions=save_router_decisions)
    if config.enable_compile:
        apply_compile(model, backend=compile_backend)
    apply_fsdp2_sharding_recursively(
        model,
        mesh=mesh,
        mp_policy=config.mp_policy if mp_policy is None else mp_policy,
        offload_policy=config.offload_policy if offload_policy is None else offload_policy,
        pp_enabled=mesh.pp_enabled if pp_enabled is None else pp_enabled,
        gradient_divide_factor=gradient_divide_factor,
        reshard_after_forward=reshard_after_forward,
        wrap_root=wrap_root,
        submodules=submodules,
    )
    if config.enable_fsdp2_prefetch:
        apply_fsdp2_prefetch(
            model,
            forward_depth=config.fsdp2_forward_prefetch_depth,
            backward_depth=config.fsdp2_backward_prefetch_depth,
        )
    if config.autocast_dtype is not None:
        apply_autocast(model, dtype=config.autocast_dtype, device_type=mesh.device_type)


def fsdp2_strategy_parallelize(
    model: nn.Module,
    *,
    mesh: MeshContext,
    config: FSDP2Config | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    sequence_parallel: bool | None = None,
    activation_checkpointing: bool | None = None,
    tp_plan: Mapping[str, Any] | str | None = None,
    gradient_divide_factor: float | None = None,
    pp_enabled: bool | None = None,
    compile_backend: str = "inductor",
) -> nn.Module:
    """Apply TP/SP, AC, compile and FSDP2 to `model` in place and return it.

    Flags come from `config` (default `FSDP2Config()`); an explicit keyword overrides its field.
    ``mp_policy`` falls back to ``config.mp_policy`` (bf16 params / fp32 reduce by default).
    The model may live on the meta device; call `materialize_meta_model` afterwards.
    """
    config = config or FSDP2Config()
    apply_tensor_parallel_from_config(
        model, mesh=mesh, config=config, tp_plan=tp_plan, sequence_parallel=sequence_parallel
    )
    apply_sharding_from_config(
        model,
        mesh=mesh,
        config=config,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        activation_checkpointing=activation_checkpointing,
        gradient_divide_factor=gradient_divide_factor,
        pp_enabled=pp_enabled,
        compile_backend=compile_backend,
    )
    return model


class FSDP2Manager:
    """Applies an `FSDP2Config` on a `MeshContext`: ``FSDP2Manager(config, mesh).parallelize(model)``."""

    def __init__(
        self,
        config: FSDP2Config,
        mesh: MeshContext,
        *,
        gradient_divide_factor: float | None = None,
        compile_backend: str = "inductor",
    ) -> None:
        if not isinstance(config, FSDP2Config):
            raise ValueError(f"config must be an FSDP2Config, got {type(config).__name__}")
        self.config = config
        self.mesh = mesh
        self.gradient_divide_factor = gradient_divide_factor
        self.compile_backend = compile_backend

    def parallelize(self, model: nn.Module) -> nn.Module:
        """`fsdp2_strategy_parallelize` with this manager's config and mesh."""
        return fsdp2_strategy_parallelize(
            model,
            mesh=self.mesh,
            config=self.config,
            gradient_divide_factor=self.gradient_divide_factor,
            compile_backend=self.compile_backend,
        )

    def grad_sync_context(self, model: nn.Module, *, is_last_microbatch: bool):
        """`grad_sync_context` honouring ``config.defer_fsdp_grad_sync``."""
        return grad_sync_context(
            model, is_last_microbatch=is_last_microbatch, enabled=self.config.defer_fsdp_grad_sync
        )
