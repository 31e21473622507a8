"""Apply the layout to a meta-device model, in one fixed order, and return the model parts.

    PP split -> per stage: TP/SP -> CP hooks -> EP -> activation checkpointing -> compile
    -> FSDP2 / DDP / Megatron-FSDP -> materialize (seeded init or pretrained weights)
    -> (optimizer, built by the loop)

Each step is delegated to its package; every option was checked when the config was parsed, so
nothing here falls back quietly. Data-parallel gradient reductions SUM
(``gradient_divide_factor=1.0``): the loop divides the loss by the global label-token count
instead, so every layout produces the same numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from automodel.mesh import MeshContext
from automodel.recipes._dist_setup import DistributedSection
from automodel.recipes.errors import ConfigError

if TYPE_CHECKING:
    from automodel.pipeline import BoundaryLayout

Initialize = Callable[[list[nn.Module]], None]


@dataclass
class ParallelModel:
    """The model parts this rank holds, and the pieces the loop needs to drive them."""

    parts: list[nn.Module]
    pipeline: Any = None  # the built pipeline (with `.step`) when pp > 1
    cp_backend: str = "none"
    defer_grad_sync: bool = True
    strategy: str = "fsdp2"

    def grad_sync(self, *, is_last_microbatch: bool) -> contextlib.AbstractContextManager:
        """Reduce data-parallel gradients only on the last micro-batch of a step (when deferring)."""
        stack = contextlib.ExitStack()
        if self.strategy == "megatron_fsdp":
            from automodel.megatron_fsdp import microbatch_grad_sync

            for part in self.parts:
                stack.enter_context(microbatch_grad_sync(part, is_last_microbatch=is_last_microbatch))
            return stack
        from automodel.fsdp2 import grad_sync_context

        for part in self.parts:
            stack.enter_context(
                grad_sync_context(part, is_last_microbatch=is_last_microbatch, enabled=self.defer_grad_sync)
            )
        return stack

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, part: nn.Module) -> torch.optim.Optimizer:
        """Hand an optimizer built on ``part.parameters()`` to the strategy (megatron-fsdp drives its step)."""
        if self.strategy != "megatron_fsdp":
            return optimizer
        from automodel.megatron_fsdp import shard_optimizer

        return shard_optimizer(optimizer, model=part)


def _materialize(parts: list[nn.Module], *, device: torch.device, seed: int, peft: Any = None) -> None:
    from automodel.fsdp2 import default_init_fn, materialize_meta_model

    for part in parts:
        init_fn = None
        if peft is not None:  # LoRA: A kaiming-uniform, B zeros; the rest as without adapters
            from automodel.recipes.peft import lora_init_fn

            config = getattr(part, "config", None)
            std = float(getattr(config, "initializer_range", 0.02) or 0.02)
            init_fn = lora_init_fn(default_init_fn(std), section=peft)
        materialize_meta_model(part, device=device, seed=seed, init_fn=init_fn)


def _weight_initializer(
    *,
    device: torch.device,
    seed: int,
    pretrained_path: str | None,
    allow_pickle_weights: bool,
    peft: Any,
) -> Initialize:
    """Materialize parts (seeded like one process), then load the pretrained checkpoint if any.

    LoRA adapters are initialised as LoRA's (B = 0) and are not looked for in the checkpoint.
    """

    def initialize(parts: list[nn.Module]) -> None:
        _materialize(parts, device=device, seed=seed, peft=peft)
        if pretrained_path is None:
            return
        from automodel.recipes.checkpoint import load_pretrained_weights

        adapters: set[str] = set()
        if peft is not None:
            from automodel.recipes.checkpoint.part_state import part_model_state_dict
            from automodel.recipes.peft import is_adapter_key

            adapters = {k for p in parts for k in part_model_state_dict(p) if is_adapter_key(k)}
        load_pretrained_weights(
            parts, pretrained_path, allow_pickle_weights=allow_pickle_weights, optional_keys=adapters
        )

    return initialize


def _parallelize_ddp(
    model: nn.Module,
    *,
    mesh: MeshContext,
    config: Any,
    gradient_divide_factor: float | None,
    initialize: Initialize,
) -> ParallelModel:
    """Weights first (DDP broadcasts real parameters), then the DDP wrapper when dp > 1."""
    from automodel.fsdp2 import DDPManager

    initialize([model])
    if mesh.layout.dp == 1:
        return ParallelModel(parts=[model], defer_grad_sync=False, strategy="ddp")
    ddp = DDPManager(config, mesh, gradient_divide_factor=gradient_divide_factor).parallelize(model)
    return ParallelModel(parts=[ddp], defer_grad_sync=True, strategy="ddp")


def _parallelize_megatron_fsdp(
    model: nn.Module,
    *,
    mesh: MeshContext,
    config: Any,
    gradient_divide_factor: float | None,
    initialize: Initialize,
) -> ParallelModel:
    """TP -> MLP AC -> weights -> megatron-fsdp (at every dp size; CUDA only)."""
    from automodel.megatron_fsdp import MegatronFSDPManager, MegatronFSDPUnavailableError

    manager = MegatronFSDPManager(config, mesh, gradient_divide_factor=gradient_divide_factor)
    try:
        wrapped, _ = manager.parallelize(model, materialize=lambda m: initialize([m]))
    except MegatronFSDPUnavailableError as e:
        raise ConfigError("distributed.strategy", "megatron_fsdp", str(e)) from None
    return ParallelModel(parts=[wrapped], strategy="megatron_fsdp", defer_grad_sync=True)


def apply_fsdp2_stack(
    module: nn.Module,
    *,
    mesh: MeshContext,
    section: DistributedSection,
    config: Any,
    gradient_divide_factor: float | None,
) -> str:
    """TP/SP -> CP hooks -> EP -> AC -> compile -> FSDP2 -> prefetch -> autocast on one model (or PP stage).

    The FSDP2 halves are automodel.fsdp2's; CP and EP go between them. With EP, automodel.moe
    shards the model (activation checkpointing and mp_policy included); the FSDP2 options it cannot
    honour are refused when the section is parsed. Returns the CP attention backend to pass to
    `make_cp_batch_and_ctx` ("none" without CP).
    """
    from automodel.fsdp2 import apply_sharding_from_config, apply_tensor_parallel_from_config

    layout = mesh.layout
    apply_tensor_parallel_from_config(module, mesh=mesh, config=config)
    cp_backend = "none"
    if layout.cp_enabled:
        from automodel.context_parallel import apply_context_parallel

        cp_backend = apply_context_parallel(module, cp_mesh=mesh.get_mesh("cp"))
    if layout.ep_enabled:
        from automodel.moe import parallelize_model as apply_expert_parallel

        apply_expert_parallel(
            module,
            mesh=mesh,
            config=section.moe_config,
            activation_checkpointing=config.activation_checkpointing,
            mp_policy=config.mp_policy,
            gradient_divide_factor=gradient_divide_factor,
            pipeline_stage=layout.pp_enabled,  # a stage may hold dense layers only
        )
        return cp_backend
    apply_sharding_from_config(
        module, mesh=mesh, config=config, gradient_divide_factor=gradient_divide_factor
    )
    return cp_backend


def _sequence_parallel_boundary(model: nn.Module, *, mesh: MeshContext, config: Any) -> BoundaryLayout | None:
    """The layout of the hidden states between pipeline stages when the TP plan shards the sequence
    (its residual stream is a ``Shard(1)`` DTensor over tp): the stages send local shards and the
    next stage rebuilds them with it. None without sequence parallelism (plain tensors cross)."""
    if not mesh.layout.tp_enabled:
        return None
    from torch.distributed.tensor import Shard

    from automodel.fsdp2.tp_plan import plan_has_sequence_parallel, resolve_tp_plan
    from automodel.pipeline import BoundaryLayout

    plan = resolve_tp_plan(model, tp_plan=config.tp_plan, sequence_parallel=config.sequence_parallel)
    if not plan_has_sequence_parallel(plan):
        return None
    return BoundaryLayout(mesh=mesh.get_mesh("tp"), placements=(Shard(1),))


def parallelize_model(
    model: nn.Module,
    *,
    mesh: MeshContext,
    section: DistributedSection,
    device: torch.device,
    seed: int,
    pipeline_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    gradient_divide_factor: float | None = 1.0,
    pretrained_path: str | None = None,
    allow_pickle_weights: bool = False,
    peft: Any = None,
) -> ParallelModel:
    """Compose the parallelisms of `section` on `model` (on the meta device) and materialize it.

    Weights are initialised (seeded, identical to one process) or loaded from the HF checkpoint
    at `pretrained_path` straight into the sharded parameters. With pp > 1,
    `pipeline_loss_fn(logits, labels)` runs on the last stage per micro-batch. `peft` is the
    `PeftSection` whose LoRA adapters `model` already carries.
    """
    config = section.strategy_config
    initialize = _weight_initializer(
        device=device,
        seed=seed,
        pretrained_path=pretrained_path,
        allow_pickle_weights=allow_pickle_weights,
        peft=peft,
    )
    strategy_kwargs = {"mesh": mesh, "config": config, "gradient_divide_factor": gradient_divide_factor}
    if section.strategy == "ddp":
        return _parallelize_ddp(model, initialize=initialize, **strategy_kwargs)
    if section.strategy == "megatron_fsdp":
        return _parallelize_megatron_fsdp(model, initialize=initialize, **strategy_kwargs)

    cp_backend = "none"

    def parallelize_stage(module: nn.Module, **_: Any) -> None:
        nonlocal cp_backend
        cp_backend = apply_fsdp2_stack(module, section=section, **strategy_kwargs)

    pipe = None
    if mesh.layout.pp_enabled:
        from automodel.pipeline import AutoPipeline

        pipe = AutoPipeline(mesh=mesh, config=section.pipeline_config, device=device).build(
            model,
            loss_fn=pipeline_loss_fn,
            parallelize_fn=parallelize_stage,
            boundary_layouts=_sequence_parallel_boundary(model, mesh=mesh, config=config),
        )
        parts = list(pipe.model_parts)
    else:
        parallelize_stage(model)
        parts = [model]
    initialize(parts)
    return ParallelModel(
        parts=parts,
        pipeline=pipe,
        cp_backend=cp_backend,
        # A pipeline schedule reduces gradients itself after its last micro-batch.
        defer_grad_sync=pipe is None and config.defer_fsdp_grad_sync,
    )
