"""Shared pieces of the automodel-fsdp2 tests: a tiny Llama, its data, and the training loops.

The loss is what the recipes compute: summed token cross-entropy divided by the global number
of label tokens, with gradient reductions summing (``gradient_divide_factor=1.0``), so every
layout must reproduce the single-process run exactly (fp32, rel 1e-5).
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from transformers import (
    GPT2LMHeadModel,
    LlamaForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

import automodel.fsdp2  # noqa: F401 - imported once here so forked ranks inherit it
from automodel.mesh.layout_report import default_layers_fqn, describe_module, rank_report
from automodel.mesh.model_parts import canonical_fqn
from automodel.testing.layout_table import Layout
from automodel.testing.tiny_model import TINY_SIZES, tiny_causal_lm

VOCAB: int = TINY_SIZES["vocab_size"]
SEQ, GBS, STEPS = 16, 8, 5
GLOBAL_TOKENS = GBS * (SEQ - 1)


def tiny_model(
    *, layers: int = 2, family: str = "llama", meta: bool = False, seed: int = 0
) -> LlamaForCausalLM | Qwen3ForCausalLM | Qwen3MoeForCausalLM | GPT2LMHeadModel:
    """The shared tiny model (`automodel.testing.tiny_model`) of `family`; ``gpt2``: decoder layers at
    transformer.h, tied embeddings, Conv1D projections."""
    if family not in ("llama", "qwen3", "qwen3_moe", "gpt2"):
        raise KeyError(family)
    model = tiny_causal_lm(family, layers=layers, seed=seed, meta=meta, use_cache=False)
    return cast("LlamaForCausalLM | Qwen3ForCausalLM | Qwen3MoeForCausalLM | GPT2LMHeadModel", model)


#: The ``distributed`` keys of a shared layout that are FSDP2Config / DDPConfig options.
_LAYOUT_OPTIONS = ("sequence_parallel", "activation_checkpointing")


def layout_spec(layout: Layout, **options: Any) -> dict[str, Any]:
    """The `train_on_rank` spec of a shared layout (`automodel.testing.layout_table`), with test
    `options` on top (``accum``, ``offload``, ``meta``, ``layers``; ``config`` merged)."""
    config = {k: layout.distributed[k] for k in _LAYOUT_OPTIONS if k in layout.distributed}
    spec: dict[str, Any] = {
        "tp": layout.size("tp_size"),
        "dp_replicate": layout.distributed.get("dp_replicate_size"),
        "family": "llama" if layout.model == "dense" else layout.model,
        **options,
        "config": {**config, **options.get("config", {})},
    }
    if layout.distributed.get("strategy") == "ddp":
        spec["strategy"] = "ddp"
    return spec


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GBS, SEQ), generator=g)


def loss_sum(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1), reduction="sum")


def make_optimizer(params, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters by canonical name; a collective when the model is sharded."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[canonical_fqn(name)] = full.detach().clone()
    return out


def reference_run(
    *, opt: str = "adamw", layers: int = 2, family: str = "llama", meta: bool = False, accum: int = 1
) -> dict[str, Any]:
    """The single-process run every layout must match."""
    model = tiny_model(layers=layers, family=family, meta=meta)
    if meta:
        from automodel.fsdp2 import materialize_meta_model

        materialize_meta_model(model, device="cpu", seed=0)
    optim = make_optimizer(model.parameters(), opt)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for mb in batch(step).chunk(accum):
            loss = loss_sum(model, mb) / GLOBAL_TOKENS
            loss.backward()
            total += loss.item()
        optim.step()
        optim.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": full_state(model)}


def _reference_on_rank(kwargs: dict) -> dict[str, Any]:
    return reference_run(**kwargs)


@functools.cache
def reference(**kwargs) -> dict[str, Any]:
    """`reference_run` in a forked single rank (the test process stays free of torch threads), cached."""
    from automodel.testing.ranks import run_on_ranks

    return run_on_ranks(_reference_on_rank, world_size=1, args=(kwargs,), timeout_s=300)[0]


def fp32_policy() -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy()


def train_on_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Parallelize the tiny model as `spec` says and train it; runs on every rank."""
    from automodel.fsdp2 import (
        DDPConfig,
        DDPManager,
        FSDP2Config,
        FSDP2Manager,
        grad_sync_context,
        materialize_meta_model,
    )
    from automodel.fsdp2.meta_init import local_numel_fraction
    from automodel.mesh import MeshContext, ParallelismSizes

    mesh = MeshContext.build(
        ParallelismSizes(tp_size=spec.get("tp", 1), dp_replicate_size=spec.get("dp_replicate"))
    )
    meta = spec.get("meta", False)
    model = tiny_model(layers=spec.get("layers", 2), family=spec.get("family", "llama"), meta=meta)
    if spec.get("strategy") == "ddp":
        manager = DDPManager(
            DDPConfig(backend="gloo", **spec.get("config", {})), mesh, gradient_divide_factor=1.0
        )
    else:
        cfg = {"backend": "gloo", "mp_policy": fp32_policy(), **spec.get("config", {})}
        if spec.get("offload"):
            cfg["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        manager = FSDP2Manager(
            FSDP2Config(**cfg),
            mesh,
            gradient_divide_factor=1.0,
            compile_backend=spec.get("compile_backend", "inductor"),
        )
    model = manager.parallelize(model)
    if meta:
        materialize_meta_model(model, device="cpu", seed=0)
    fraction = local_numel_fraction(model)
    part = describe_module(model, layers_fqn=default_layers_fqn(model))
    report = rank_report(parts=[part], mesh=mesh, strategy=spec.get("strategy", "fsdp2"))
    optim = make_optimizer(model.parameters(), spec.get("opt", "adamw"))
    coords, layout = mesh.coordinates, mesh.layout
    dp_rank = coords["dp_replicate"] * layout.dp_shard + coords["dp_shard"]
    dp_group = mesh.get_mesh("dp").get_group() if layout.dp > 1 else None
    accum = spec.get("accum", 1)
    losses = []
    for step in range(STEPS):
        local = batch(step).chunk(layout.dp)[dp_rank]
        micro = local.chunk(accum)
        total = torch.zeros(())
        for j, mb in enumerate(micro):
            with grad_sync_context(model, is_last_microbatch=j == len(micro) - 1):
                loss = loss_sum(model, mb) / GLOBAL_TOKENS
                loss.backward()
            total += loss.detach()
        optim.step()
        optim.zero_grad()
        if dp_group is not None:
            dist.all_reduce(total, group=dp_group)
        losses.append(total.item())
    state = full_state(model) if spec.get("return_state") else None
    return {
        "losses": losses,
        "state": state if dist.get_rank() == 0 else None,
        "local_fraction": fraction,
        "report": report,  # what this rank holds (automodel.mesh.layout_report)
    }
