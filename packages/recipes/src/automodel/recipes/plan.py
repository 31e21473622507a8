"""`recipes validate`: resolve the config and the whole layout for W ranks without training.

Every pre-launch check runs (`resolved_run.resolve_run`, machine-neutral: the meshes are built in one process
through torch's fake process-group backend, every rule is checked), and the per-rank peak memory of a step is estimated (`planning.memory`): parameters,
gradients, optimizer state, activations by AC mode, logits and loss, in-flight pipeline
micro-batches and communication buffers, from the meta-device model's sizes.
"""

from __future__ import annotations

import dataclasses

from automodel.mesh import ResolvedLayout, axes
from automodel.mesh.model_parts import text_config
from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.model import build_meta_model
from automodel.recipes.parallelisms import batch_ranks, in_plan_order, parallelisms
from automodel.recipes.peft import apply_lora
from automodel.recipes.planning.memory import MemoryEstimate, StepSetup, estimate_step_memory
from automodel.recipes.planning.setup import step_setup
from automodel.recipes.planning.shape import model_shape
from automodel.recipes.planning.terms import memory_terms, planner_sizes
from automodel.recipes.resolved_run import resolve_run


def _trainable_params(cfg: RecipeConfig, model) -> int | None:
    """LoRA: the adapter parameters (the only ones with gradients and optimizer state).

    Adds the adapters to `model` in place: call it last on the meta model."""
    if cfg.peft is None:
        return None

    apply_lora(model, section=cfg.peft)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def estimate_memory(
    cfg: RecipeConfig,
    layout: ResolvedLayout,
    hf_config,
    *,
    stages: int = 1,
    on_gpu: bool | None = None,
    model=None,
    expert_load_factor: float = 1.0,
) -> MemoryEstimate:
    """Per-rank peak bytes of one step of `cfg` under `layout` (see `planning.memory`).

    `model`: the meta-device model of `cfg` if the caller built it (it gets LoRA adapters when
    `cfg.peft` is set, so it must not be used afterwards); otherwise one is built here."""
    return _estimate(
        cfg,
        layout,
        hf_config,
        stages=stages,
        on_gpu=on_gpu,
        model=model,
        expert_load_factor=expert_load_factor,
    )[0]


def _estimate(
    cfg: RecipeConfig,
    layout: ResolvedLayout,
    hf_config,
    *,
    stages: int,
    on_gpu: bool | None,
    model,
    expert_load_factor: float,
) -> tuple[MemoryEstimate, StepSetup]:
    """`estimate_memory` and the step setup it estimated (the parallelisms' report lines read it)."""
    if model is None:
        model = _meta_model(cfg, hf_config)
    shape = model_shape(hf_config, model=model)
    setup = step_setup(cfg, layout, stages=stages, on_gpu=on_gpu, expert_load_factor=expert_load_factor)
    setup = dataclasses.replace(
        setup,
        trainable_params=_trainable_params(cfg, model),
        sizes=(*setup.sizes, *planner_sizes(cfg.distributed, layout)),
    )
    extra = memory_terms(cfg.distributed, layout, setup=setup, shape=shape)
    if extra:
        setup = dataclasses.replace(setup, extra_bytes=extra)
    return estimate_step_memory(shape, setup), setup


def _meta_model(cfg: RecipeConfig, hf_config):
    return build_meta_model(hf_config, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)


def _gib(x: float) -> str:
    return f"{x / 2**30:,.2f} GiB" if x >= 2**30 else f"{x / 2**20:,.2f} MiB"


def plan_layout(
    cfg: RecipeConfig, *, world_size: int, on_gpu: bool | None = None, expert_load_factor: float = 1.0
) -> tuple[ResolvedLayout, MemoryEstimate, list[str]]:
    """`resolved_run.resolve_run` for `world_size` ranks, machine-neutral (every check `recipes train` runs, except
    the files and the environment of this machine, which it reports as a line), then the memory
    estimate; returns the report lines.

    `on_gpu` picks the default mixed precision the estimate assumes (None: this machine's);
    `expert_load_factor` the busiest EP rank's routed slots over the mean (1: balanced routing)."""
    # One meta-device model per call, shared by the rules, the parameter counts and LoRA (in that
    # order: LoRA adds adapters in place). A 70B model costs ~0.2 s to build.
    checked = resolve_run(cfg, world_size=world_size, this_machine=False)
    layout, hf_config, stages = checked.layout, checked.hf_config, checked.stages
    mem, setup = _estimate(
        cfg,
        layout,
        hf_config,
        stages=stages,
        on_gpu=on_gpu,
        model=checked.take_meta_model(),
        expert_load_factor=expert_load_factor,
    )
    ss = cfg.step_scheduler
    accum = ss.global_batch_size // (ss.local_batch_size * batch_ranks(layout))
    lines = [
        f"config OK for world_size={world_size} (strategy={cfg.distributed.strategy})",
        "",
        f"{'axis':<14}{'size':>8}",
    ]
    # the MoE mesh's axes only when it exists: one of its sized axes has more than one rank
    moe_mesh = any(layout.enabled(row.name) for row in axes() if row.mesh == "moe" and row.size_key)
    for row in axes():
        if row.mesh != "moe" or moe_mesh:
            lines.append(f"{row.name:<14}{layout.axis_size(row.name):>8}")
    for parallelism in parallelisms():  # the registered parallelisms that form no mesh axis
        if parallelism.mesh_axis is None:
            lines.append(f"{parallelism.name:<14}{parallelism.size(cfg.distributed, layout):>8}")
    lines += [
        "",
        f"model: {hf_config.model_type}, {text_config(hf_config).num_hidden_layers} layers, "
        f"{mem.total_params:,} parameters",
        f"sequence length {cfg.seq_length}, global batch {ss.global_batch_size}, local batch {ss.local_batch_size}, "
        f"gradient accumulation {accum}",
    ]
    for parallelism in in_plan_order():  # the pipeline's schedule, the expert load assumed
        lines += parallelism.validate_lines(
            cfg=cfg,
            layout=layout,
            size=parallelism.size(cfg.distributed, layout),
            stages=stages,
            setup=setup,
        )
    lines += [
        "",
        f"per-rank memory estimate (peak at {mem.peak_phase}; see docs/planning.md):",
        f"  parameters  {mem.params_per_rank:>16,.0f} elements  {_gib(mem.param_bytes):>14}",
        f"  gradients   {'':>16}           {_gib(mem.grad_bytes):>14}   (all, at the optimizer step)",
        f"  optimizer   {'':>16}           {_gib(mem.optimizer_bytes):>14}",
        f"  activations {'':>16}           {_gib(mem.activation_bytes):>14}   (one micro-batch, "
        f"{'checkpointed layers' if setup_ac(cfg) else 'no checkpointing'})",
        f"  logits+loss {'':>16}           {_gib(mem.logits_bytes):>14}",
        f"  pipeline    {'':>16}           {_gib(mem.pipeline_bytes):>14}   (other in-flight micro-batches)",
        f"  buffers     {'':>16}           {_gib(mem.buffer_bytes):>14}   (unsharded FSDP weights, buckets, p2p)",
        f"  peak        {'':>16}           {_gib(mem.peak_bytes):>14}   "
        + ", ".join(f"{k} {_gib(v)}" for k, v in mem.peak_parts.items() if v),
    ]
    lines += [f"note: {line}" for line in cfg.notes]  # what differs from NeMo AutoModel (compat)
    lines += [f"recipes train on this machine refuses before launch: {e}" for e in checked.machine_refusals]
    return layout, mem, lines


def setup_ac(cfg: RecipeConfig) -> bool:
    return "activation_checkpointing" in cfg.distributed.strategy_config.enabled_layer_flags
