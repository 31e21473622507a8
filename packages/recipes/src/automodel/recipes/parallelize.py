"""Apply the layout to a meta-device model in DESIGN §2 order and return the model parts.

    PP split -> per stage: TP/SP -> CP hooks -> EP -> activation checkpointing -> compile
    -> FSDP2 / DDP / Megatron-FSDP -> (materialize, done by the caller) -> optimizer

Each layout is delegated to its package; a layout whose package API is not installed yet is a
`ConfigError` ("not available yet"), never a silent fallback to another layout. Data-parallel
gradient reductions SUM (``gradient_divide_factor=1.0``): the loop divides the loss by the global
label-token count instead, so every layout produces the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from automodel.mesh import MeshContext
from automodel.recipes._dist_setup import DistributedSection
from automodel.recipes.availability import require_api
from automodel.recipes.errors import ConfigError
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


@dataclass
class ParallelModel:
    """The model parts this rank holds, and the pieces the loop needs to drive them."""

    parts: list[nn.Module]
    pipeline: Any = None  # the pipeline object with `.step` when pp > 1
    fsdp_modules: list[FSDPModule] = field(default_factory=list)
    cp_enabled: bool = False


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer block list of a transformers causal LM (``model.model.layers``)."""
    for name, mod in model.named_modules():
        if name.endswith("layers") and isinstance(mod, nn.ModuleList):
            return mod
    raise ValueError(f"{type(model).__name__} has no ModuleList of decoder layers")


def default_mp_policy(options: dict) -> MixedPrecisionPolicy:
    """YAML's mp_policy if given; else the seed's bf16 default on CUDA and full precision on CPU."""
    mp = options.get("mp_policy")
    if mp is not None:
        return mp
    if torch.cuda.is_available():
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
        )
    return MixedPrecisionPolicy()


def apply_activation_checkpointing(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = decoder_layers(model)
    for i, layer in enumerate(list(layers)):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def _fsdp_mesh(mesh: MeshContext):
    if mesh.layout.dp_replicate > 1:
        return mesh.device_mesh[("dp_replicate", "dp_shard_cp")]
    return mesh.get_mesh("dp_shard_cp")


def apply_fsdp(
    model: nn.Module, *, mesh: MeshContext, options: dict, gradient_divide_factor: float | None
) -> list:
    """FSDP2 (HSDP when dp_replicate > 1): each decoder layer, then the root."""
    if mesh.layout.dp_shard_cp * mesh.layout.dp_replicate == 1:
        return []
    dp_mesh = _fsdp_mesh(mesh)
    mp = default_mp_policy(options)
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp}
    if options.get("offload_policy") is not None:
        kwargs["offload_policy"] = options["offload_policy"]
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if gradient_divide_factor is not None:
        for m in modules:
            m.set_gradient_divide_factor(gradient_divide_factor)
    return modules


def _sum_allreduce_hook(process_group: Any, bucket: Any) -> Any:
    import torch.distributed as dist

    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def apply_ddp(model: nn.Module, *, mesh: MeshContext, gradient_divide_factor: float | None) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    if mesh.layout.dp == 1:
        return model
    group = mesh.get_mesh("dp").get_group()
    ddp = DistributedDataParallel(model, process_group=group)
    if gradient_divide_factor == 1.0:
        ddp.register_comm_hook(group, _sum_allreduce_hook)
    elif gradient_divide_factor is not None:
        raise ValueError(f"ddp supports gradient_divide_factor None or 1.0, got {gradient_divide_factor}")
    return ddp


def parallelize_model(
    model: nn.Module,
    *,
    mesh: MeshContext,
    section: DistributedSection,
    hf_config: Any,
    loss_fn: Any = None,
    gradient_divide_factor: float | None = 1.0,
) -> ParallelModel:
    """Compose the parallelisms of `section` on `model` (still on the meta device)."""
    layout = mesh.layout
    options = dict(section.options)
    if layout.pp > 1:
        require_api("automodel.pipeline", "AutoPipeline", key="distributed.pp_size", value=layout.pp)
    if layout.tp > 1:
        require_api("automodel.fsdp2", "apply_tp", key="distributed.tp_size", value=layout.tp)
    if layout.cp > 1:
        require_api(
            "automodel.context_parallel", "make_cp_batch_and_ctx", key="distributed.cp_size", value=layout.cp
        )
    if layout.ep > 1:
        require_api("automodel.moe", "parallelize_model", key="distributed.ep_size", value=layout.ep)
    if section.strategy == "megatron_fsdp":
        require_api(
            "automodel.megatron_fsdp",
            "MegatronFSDPManager",
            key="distributed.strategy",
            value=section.strategy,
        )
    if options.get("enable_compile"):
        raise ConfigError(
            "distributed.enable_compile", True, "needs automodel.fsdp2.apply_compile, not available yet"
        )
    if section.activation_checkpointing:
        apply_activation_checkpointing(model)
    if section.strategy == "ddp":
        return ParallelModel(
            parts=[apply_ddp(model, mesh=mesh, gradient_divide_factor=gradient_divide_factor)]
        )
    fsdp = apply_fsdp(model, mesh=mesh, options=options, gradient_divide_factor=gradient_divide_factor)
    return ParallelModel(parts=[model], fsdp_modules=fsdp)
