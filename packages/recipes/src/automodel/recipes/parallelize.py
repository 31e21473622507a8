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
from dataclasses import dataclass, field
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
    cp_enabled: bool = False
    defer_grad_sync: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def grad_sync(self, *, is_last_microbatch: bool) -> contextlib.AbstractContextManager:
        """Reduce data-parallel gradients only on the last micro-batch of a step (when deferring)."""
        from automodel.fsdp2 import grad_sync_context

        stack = contextlib.ExitStack()
        for part in self.parts:
            stack.enter_context(
                grad_sync_context(part, is_last_microbatch=is_last_microbatch, enabled=self.defer_grad_sync)
            )
        return stack


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


def _materialize(parts: list[nn.Module], *, device: torch.device, seed: int) -> None:
    from automodel.fsdp2 import materialize_meta_model

    for part in parts:
        materialize_meta_model(part, device=device, seed=seed)


def parallelize_model(
    model: nn.Module,
    *,
    mesh: MeshContext,
    section: DistributedSection,
    hf_config: Any,
    device: torch.device,
    seed: int,
    loss_fn: Any = None,
    gradient_divide_factor: float | None = 1.0,
) -> ParallelModel:
    """Compose the parallelisms of `section` on `model` (on the meta device) and materialize it."""
    layout = mesh.layout
    config = strategy_config(section)
    if layout.pp > 1:
        require_api("automodel.pipeline", "AutoPipeline", key="distributed.pp_size", value=layout.pp)
    if layout.cp > 1:
        require_api(
            "automodel.context_parallel", "make_cp_batch_and_ctx", key="distributed.cp_size", value=layout.cp
        )
    if layout.ep > 1:
        require_api("automodel.moe", "parallelize_model", key="distributed.ep_size", value=layout.ep)

    if section.strategy == "ddp":
        from automodel.fsdp2 import DDPManager

        _materialize([model], device=device, seed=seed)  # DDP broadcasts real parameters
        if layout.dp == 1:
            return ParallelModel(parts=[model], defer_grad_sync=False)
        ddp = DDPManager(config, mesh, gradient_divide_factor=gradient_divide_factor).parallelize(model)
        return ParallelModel(parts=[ddp], defer_grad_sync=True)

    if section.strategy == "megatron_fsdp":
        (manager_cls,) = require_api(
            "automodel.megatron_fsdp",
            "MegatronFSDPManager",
            key="distributed.strategy",
            value="megatron_fsdp",
        )
        if not torch.cuda.is_available():
            raise ConfigError(
                "distributed.strategy", "megatron_fsdp", "needs CUDA (megatron-fsdp runs on GPUs only)"
            )
        manager = manager_cls(config, mesh)
        parts = [manager.parallelize(model)]
        return ParallelModel(parts=parts, defer_grad_sync=False, extra={"manager": manager})

    from automodel.fsdp2 import fsdp2_strategy_parallelize

    fsdp2_strategy_parallelize(model, mesh=mesh, config=config, gradient_divide_factor=gradient_divide_factor)
    _materialize([model], device=device, seed=seed)
    return ParallelModel(parts=[model], defer_grad_sync=config.defer_fsdp_grad_sync)
