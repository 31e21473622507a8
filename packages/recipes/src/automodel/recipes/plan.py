"""`recipes validate`: resolve the config and the whole layout for W ranks without training.

The meshes are built in one process through torch's fake process-group backend, every rule is
checked, and the per-rank memory of parameters, gradients and optimizer state is estimated from
the meta-device model (fp32 master weights and gradients, two fp32 Adam moments).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from automodel.mesh import MeshContext, ResolvedLayout, fake_world
from automodel.recipes._dist_setup import resolve_layout
from automodel.recipes.model import build_hf_config, build_meta_model
from automodel.recipes.recipe_config import RecipeConfig
from automodel.recipes.rules import check_layout_rules, pipeline_stages

_EXPERT_MARKERS = (".experts.",)


@dataclass
class MemoryEstimate:
    """Per-rank bytes of weights, gradients and optimizer state (activations excluded)."""

    total_params: int
    params_per_rank: float
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def _optimizer_states(target: str) -> int:
    """fp32 state tensors per parameter: Adam-like optimizers keep two moments, others one."""
    name = target.rsplit(".", 1)[-1].lower()
    return 1 if name in ("sgd", "adagrad", "rmsprop") else 2


def estimate_memory(cfg: RecipeConfig, layout: ResolvedLayout, hf_config) -> MemoryEstimate:
    """Per-rank bytes under `layout` and the strategy's sharding of weights, grads and state."""
    model = build_meta_model(hf_config, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    expert = sum(p.numel() for n, p in model.named_parameters() if any(m in f".{n}" for m in _EXPERT_MARKERS))
    dense = sum(p.numel() for p in model.parameters()) - expert
    # model-parallel split first (tp for dense weights, ep for experts, pp for layers) ...
    dense_mp = dense / layout.tp / layout.pp
    expert_mp = (expert / layout.ep if layout.ep_enabled else expert / layout.tp) / layout.pp
    # ... then the data-parallel shard factor of (weights, grads, optimizer state)
    strategy = cfg.distributed.strategy
    if strategy == "ddp":
        shards = {"w": (1, 1), "g": (1, 1), "o": (1, 1)}
    elif strategy == "megatron_fsdp":
        zero = int(cfg.distributed.options.get("zero_dp_strategy", 3))
        n = layout.dp_cp
        shards = {k: ((n, n) if zero >= level else (1, 1)) for k, level in (("w", 3), ("g", 2), ("o", 1))}
    else:  # fsdp2: dense over dp_shard*cp (HSDP replicates over dp_replicate), experts over ep_shard
        ex = layout.ep_shard if layout.ep_enabled else layout.dp_shard_cp
        shards = {k: (layout.dp_shard_cp, ex) for k in ("w", "g", "o")}

    def per_rank(kind: str) -> float:
        d, e = shards[kind]
        return dense_mp / d + expert_mp / e

    elem = torch.empty((), dtype=getattr(torch, cfg.model.dtype)).element_size()
    grad_elem, master_bytes = elem, 0.0
    if strategy == "megatron_fsdp":
        # megatron-fsdp's buffers: main grads in fp32 with grad_reduce_in_fp32; an fp32 copy of the
        # weights (sharded like the optimizer state) with preserve_fp32_weights.
        options = cfg.distributed.options
        grad_elem = 4 if options.get("grad_reduce_in_fp32") else elem
        master_bytes = per_rank("o") * 4 if options.get("preserve_fp32_weights") else 0.0
    return MemoryEstimate(
        total_params=dense + expert,
        params_per_rank=per_rank("w"),
        param_bytes=per_rank("w") * elem,
        grad_bytes=per_rank("g") * grad_elem,
        optimizer_bytes=per_rank("o") * 4 * _optimizer_states(cfg.optimizer.target) + master_bytes,
    )


def _gib(x: float) -> str:
    return f"{x / 2**30:,.2f} GiB" if x >= 2**30 else f"{x / 2**20:,.2f} MiB"


def plan_layout(cfg: RecipeConfig, *, world_size: int) -> tuple[ResolvedLayout, MemoryEstimate, list[str]]:
    """Build every mesh for `world_size` fake ranks, check every rule; return the report lines."""
    layout = resolve_layout(cfg.distributed, world_size)
    hf_config = build_hf_config(cfg.model, announce=False)  # the run announces remote code once
    check_layout_rules(cfg, layout, hf_config)
    with fake_world(world_size):
        mesh = MeshContext.build(cfg.distributed.sizes, device_type="cpu")
        assert mesh.layout == layout
    mem = estimate_memory(cfg, layout, hf_config)
    ss = cfg.step_scheduler
    accum = ss.global_batch_size // (ss.local_batch_size * layout.dp)
    lines = [
        f"config OK for world_size={world_size} (strategy={cfg.distributed.strategy})",
        "",
        f"{'axis':<14}{'size':>8}",
    ]
    for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp"):
        lines.append(f"{axis:<14}{layout.axis_size(axis):>8}")
    if layout.ep_enabled:
        lines += [f"{'ep':<14}{layout.ep:>8}", f"{'ep_shard':<14}{layout.ep_shard:>8}"]
    lines += [
        "",
        f"model: {hf_config.model_type}, {hf_config.num_hidden_layers} layers, {mem.total_params:,} parameters",
        f"sequence length {cfg.seq_length}, global batch {ss.global_batch_size}, local batch {ss.local_batch_size}, "
        f"gradient accumulation {accum}",
    ]
    if layout.pp_enabled:
        pipe = cfg.distributed.pipeline or {}
        lines.append(
            f"pipeline: {pipe.get('pp_schedule', '1f1b')}, {pipeline_stages(cfg, layout, hf_config)} stages, "
            f"micro-batch {pipe.get('pp_microbatch_size', 1)}"
        )
    lines += [
        "",
        "per-rank memory estimate (weights, grads, optimizer state; activations not included):",
        f"  parameters  {mem.params_per_rank:>16,.0f} elements  {_gib(mem.param_bytes):>14}",
        f"  gradients   {'':>16}           {_gib(mem.grad_bytes):>14}",
        f"  optimizer   {'':>16}           {_gib(mem.optimizer_bytes):>14}",
        f"  total       {'':>16}           {_gib(mem.total_bytes):>14}",
    ]
    return layout, mem, lines
