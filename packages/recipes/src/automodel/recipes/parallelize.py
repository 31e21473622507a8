"""Apply the layout to a meta-device model in DESIGN §2 order and return the model parts.

    PP split -> per stage: TP/SP -> CP hooks -> EP -> activation checkpointing -> compile
    -> FSDP2 / DDP / Megatron-FSDP -> materialize -> (optimizer, built by the loop)

Each layout is delegated to its package; a layout whose package API is not installed yet is a
`ConfigError` ("not available yet"), never a silent fallback to another layout. Data-parallel
gradient reductions SUM (``gradient_divide_factor=1.0``): the loop divides the loss by the global
label-token count instead, so every layout produces the same numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from automodel.mesh import MeshContext
from automodel.recipes._dist_setup import DistributedSection
from automodel.recipes.availability import require_api
from automodel.recipes.errors import ConfigError


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


def default_mp_policy(options: dict) -> MixedPrecisionPolicy:
    """YAML's mp_policy if given; else the seed's bf16 default on CUDA and full precision on CPU."""
    mp = options.get("mp_policy")
    if mp is not None:
        return mp
    if torch.cuda.is_available():
        from automodel.fsdp2 import default_mp_policy as seed_default

        return seed_default()
    return MixedPrecisionPolicy()


def strategy_config(section: DistributedSection) -> Any:
    """The strategy's config dataclass built from the section's flags (errors name the key)."""
    if section.strategy == "fsdp2":
        (cls,) = require_api("automodel.fsdp2", "FSDP2Config", key="distributed.strategy", value="fsdp2")
        options = dict(section.options)
        options["mp_policy"] = default_mp_policy(options)
    elif section.strategy == "ddp":
        (cls,) = require_api("automodel.fsdp2", "DDPConfig", key="distributed.strategy", value="ddp")
        options = dict(section.options)
    else:
        (cls,) = require_api(
            "automodel.megatron_fsdp", "MegatronFSDPConfig", key="distributed.strategy", value="megatron_fsdp"
        )
        options = dict(section.options)
    options.setdefault("backend", "nccl" if torch.cuda.is_available() else "gloo")
    try:
        return cls(**options)
    except (ValueError, TypeError) as e:
        msg = str(e)
        key = next((k for k in options if msg.startswith(k) or f"{k} " in msg or f"{k}." in msg), None)
        raise ConfigError(f"distributed.{key}" if key else "distributed", options.get(key), msg) from None


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


def _parallelize_megatron_fsdp(
    model: nn.Module,
    *,
    mesh: MeshContext,
    config: Any,
    gradient_divide_factor: float | None,
    initialize: Callable[[list[nn.Module]], None],
) -> ParallelModel:
    """TP -> MLP AC -> weights -> megatron-fsdp (at every dp size; CUDA only)."""
    from automodel.megatron_fsdp import MegatronFSDPManager, MegatronFSDPUnavailableError

    if config.init_fsdp_with_meta_device:
        raise ConfigError(
            "distributed.init_fsdp_with_meta_device",
            True,
            "is not supported by the recipes: they initialise (or load) the TP-sharded weights "
            "before megatron-fsdp wraps the model, identically to fsdp2; set it to false",
        )
    manager = MegatronFSDPManager(config, mesh, gradient_divide_factor=gradient_divide_factor)
    try:
        wrapped, _ = manager.parallelize(model, materialize=lambda m: initialize([m]))
    except MegatronFSDPUnavailableError as e:
        raise ConfigError("distributed.strategy", "megatron_fsdp", str(e)) from None
    return ParallelModel(parts=[wrapped], strategy="megatron_fsdp", defer_grad_sync=True)


def _moe_config(section: DistributedSection) -> Any:
    (cls,) = require_api(
        "automodel.moe", "MoEParallelizerConfig", key="distributed.ep_size", value=section.sizes.ep_size
    )
    try:
        return cls(**(section.moe or {}))
    except (ValueError, TypeError) as e:
        raise ConfigError("distributed.moe", section.moe, str(e)) from None


def pipeline_config(section: DistributedSection, *, local_batch_size: int) -> Any:
    """`PipelineConfig` from ``distributed.pipeline``; one pipeline step takes one local batch."""
    (cls,) = require_api(
        "automodel.pipeline", "PipelineConfig", key="distributed.pp_size", value=section.sizes.pp_size
    )
    options = dict(section.pipeline or {})
    if "pp_batch_size" in options and options["pp_batch_size"] != local_batch_size:
        raise ConfigError(
            "distributed.pipeline.pp_batch_size",
            options["pp_batch_size"],
            f"must equal step_scheduler.local_batch_size={local_batch_size} (or be left out)",
        )
    options["pp_batch_size"] = local_batch_size
    try:
        return cls(**options)
    except (ValueError, TypeError) as e:
        msg = str(e)
        key = next((k for k in options if msg.startswith(k) or f"{k}=" in msg), None)
        where = f"distributed.pipeline.{key}" if key else "distributed.pipeline"
        raise ConfigError(where, options.get(key, section.pipeline), msg) from None


def apply_fsdp2_stack(
    module: nn.Module,
    *,
    mesh: MeshContext,
    section: DistributedSection,
    config: Any,
    gradient_divide_factor: float | None,
) -> str:
    """TP/SP -> CP hooks -> EP -> AC -> compile -> FSDP2 -> prefetch on one model (or PP stage).

    Returns the CP attention backend to pass to `make_cp_batch_and_ctx` ("none" without CP).
    """
    import automodel.fsdp2 as F

    layout = mesh.layout
    if config.patch_is_packed_sequence:
        F.patch_is_packed_sequence()
    tp_mesh = mesh.get_optional_mesh("tp")
    if tp_mesh is not None:
        F.apply_tp(
            module, tp_mesh=tp_mesh, tp_plan=config.tp_plan, sequence_parallel=config.sequence_parallel
        )
        if config.enable_async_tensor_parallel:
            F.enable_async_tp(tp_mesh)
    cp_backend = "none"
    if layout.cp_enabled:
        (apply_cp,) = require_api(
            "automodel.context_parallel", "apply_context_parallel", key="distributed.cp_size", value=layout.cp
        )
        cp_backend = apply_cp(module, cp_mesh=mesh.get_mesh("cp"))
    if layout.ep_enabled:
        (moe_parallelize,) = require_api(
            "automodel.moe", "parallelize_model", key="distributed.ep_size", value=layout.ep
        )
        if config.enable_compile:
            raise ConfigError(
                "distributed.enable_compile", True, "is not supported together with ep_size > 1"
            )
        moe_parallelize(
            module,
            mesh=mesh,
            config=_moe_config(section),
            activation_checkpointing=config.activation_checkpointing,
            mp_policy=config.mp_policy,
            gradient_divide_factor=gradient_divide_factor,
        )
        return cp_backend
    if config.activation_checkpointing:
        F.apply_activation_checkpointing(module)
    if config.enable_compile:
        F.apply_compile(module)
    F.apply_fsdp2_sharding_recursively(
        module,
        mesh=mesh,
        mp_policy=config.mp_policy,
        offload_policy=config.offload_policy,
        pp_enabled=layout.pp_enabled,
        gradient_divide_factor=gradient_divide_factor,
    )
    if config.enable_fsdp2_prefetch:
        F.apply_fsdp2_prefetch(
            module,
            forward_depth=config.fsdp2_forward_prefetch_depth,
            backward_depth=config.fsdp2_backward_prefetch_depth,
        )
    if config.autocast_dtype is not None:
        F.apply_autocast(module, dtype=config.autocast_dtype, device_type=mesh.device_type)
    return cp_backend


def parallelize_model(
    model: nn.Module,
    *,
    mesh: MeshContext,
    section: DistributedSection,
    device: torch.device,
    seed: int,
    local_batch_size: int,
    pipeline_loss_fn: Any = None,
    gradient_divide_factor: float | None = 1.0,
    pretrained_path: str | None = None,
    allow_pickle_weights: bool = False,
    peft: Any = None,
) -> ParallelModel:
    """Compose the parallelisms of `section` on `model` (on the meta device) and materialize it.

    Weights are initialised (seeded, identical to one process) or loaded from the HF
    checkpoint at `pretrained_path` straight into the sharded parameters. With pp > 1,
    `pipeline_loss_fn(logits, labels)` runs on the last stage per micro-batch. With `peft` (the
    `PeftSection` whose LoRA adapters `model` already carries) the adapters are initialised as
    LoRA's (B = 0) and are not looked for in the pretrained checkpoint.
    """
    layout = mesh.layout
    config = strategy_config(section)

    def initialize(parts: list[nn.Module]) -> None:
        _materialize(parts, device=device, seed=seed, peft=peft)
        if pretrained_path is not None:
            from automodel.recipes.checkpoint import load_pretrained_weights

            adapters: set[str] = set()
            if peft is not None:
                from automodel.recipes.checkpoint.part_state import part_model_state_dict
                from automodel.recipes.peft import is_adapter_key

                adapters = {k for p in parts for k in part_model_state_dict(p) if is_adapter_key(k)}
            load_pretrained_weights(
                parts, pretrained_path, allow_pickle_weights=allow_pickle_weights, optional_keys=adapters
            )

    if section.strategy == "ddp":
        from automodel.fsdp2 import DDPManager

        initialize([model])  # DDP broadcasts real parameters
        if layout.dp == 1:
            return ParallelModel(parts=[model], defer_grad_sync=False, strategy="ddp")
        ddp = DDPManager(config, mesh, gradient_divide_factor=gradient_divide_factor).parallelize(model)
        return ParallelModel(parts=[ddp], defer_grad_sync=True, strategy="ddp")

    if section.strategy == "megatron_fsdp":
        return _parallelize_megatron_fsdp(
            model,
            mesh=mesh,
            config=config,
            gradient_divide_factor=gradient_divide_factor,
            initialize=initialize,
        )

    cp_backend = "none"

    def parallelize_stage(module: nn.Module, **_: Any) -> None:
        nonlocal cp_backend
        cp_backend = apply_fsdp2_stack(
            module, mesh=mesh, section=section, config=config, gradient_divide_factor=gradient_divide_factor
        )

    if layout.pp_enabled:
        (auto_pipeline,) = require_api(
            "automodel.pipeline", "AutoPipeline", key="distributed.pp_size", value=layout.pp
        )
        pcfg = pipeline_config(section, local_batch_size=local_batch_size)
        pipe = auto_pipeline(mesh=mesh, config=pcfg, device=device).build(
            model, loss_fn=pipeline_loss_fn, parallelize_fn=parallelize_stage
        )
        parts = list(pipe.model_parts)
        initialize(parts)
        return ParallelModel(parts=parts, pipeline=pipe, cp_backend=cp_backend, defer_grad_sync=False)
    parallelize_stage(model)
    initialize([model])
    return ParallelModel(parts=[model], cp_backend=cp_backend, defer_grad_sync=config.defer_fsdp_grad_sync)
