"""`apply_tp`: tensor (and sequence) parallelism on a model, from a resolved plan."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from automodel.fsdp2.torch_internals import enable_async_tp_internals
from automodel.fsdp2.tp_plan import (
    check_plan_matches_model,
    check_plan_shards_every_layer,
    plan_has_sequence_parallel,
    resolve_tp_plan,
    validate_tp_mesh,
    with_lora_adapters,
)


def _add_position_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Sequence-sharded embeddings hide the sequence length from HF: pass positions explicitly."""
    if kwargs.get("position_ids") is not None:
        return args, kwargs
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            return args, kwargs
        seq_len, device = embeds.shape[1], embeds.device
    else:
        seq_len, device = ids.shape[1], ids.device
    kwargs = dict(kwargs)
    kwargs["position_ids"] = torch.arange(seq_len, device=device).unsqueeze(0)
    return args, kwargs


def apply_tp(
    model: nn.Module,
    *,
    tp_mesh: DeviceMesh,
    tp_plan: Mapping[str, Any] | str | None = None,
    sequence_parallel: bool = False,
) -> dict[str, ParallelStyle]:
    """Shard `model` over `tp_mesh` in place; returns the plan that was applied.

    The plan is resolved by `resolve_tp_plan` (explicit -> HF -> Llama default). Heads must divide
    the TP size and every plan key must name a module, else ValueError. When the plan shards the
    sequence, a pre-hook fills ``position_ids`` if the caller gave none. A LoRA-wrapped linear
    (``lora_A``/``lora_B`` children) follows its plan key (`with_lora_adapters`).
    """
    validate_tp_mesh(model, tp_mesh)
    plan = resolve_tp_plan(model, tp_plan=tp_plan, sequence_parallel=sequence_parallel)
    plan = with_lora_adapters(model, plan)
    check_plan_matches_model(model, plan)
    check_plan_shards_every_layer(model, plan)
    # torch's SequenceParallel (and the replication of parameters a style leaves alone) re-creates
    # parameters with requires_grad=True: frozen ones (a LoRA base model's norms) must stay frozen.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*could not be resolved.*")
        parallelize_module(model, tp_mesh, plan)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    if plan_has_sequence_parallel(plan):
        model.register_forward_pre_hook(_add_position_ids, with_kwargs=True)
    return plan


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Async TP (inductor micro-pipelining + symmetric memory); CUDA and torch.compile only."""
    if tp_mesh.device_type != "cuda":
        raise ValueError(
            f"enable_async_tensor_parallel needs a CUDA mesh, got device_type={tp_mesh.device_type!r}"
        )
    enable_async_tp_internals(tp_mesh.get_group().group_name)
