"""A recipe config and its resolved layout -> the `StepSetup` the memory estimate reads."""

from __future__ import annotations

from typing import Any

import torch

from automodel.mesh import ResolvedLayout, parse_dtype
from automodel.recipes._dist_setup import resolve_machine_defaults
from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.linear_ce import CHUNK_ELEMENTS
from automodel.recipes.output_head import is_linear_loss
from automodel.recipes.parallelisms import batch_ranks, parallelisms
from automodel.recipes.planning.memory import StepSetup
from automodel.recipes.strategies import get_strategy

_ONE_STATE = ("sgd", "adagrad", "rmsprop")


def _elem(dtype: Any, default: int, *, key: str) -> int:
    """Bytes per element of a dtype or dtype name (every spelling `parse_dtype` accepts)."""
    parsed = parse_dtype(dtype, key=key)
    return default if parsed is None else torch.empty((), dtype=parsed).element_size()


def optimizer_states(target: str) -> int:
    """fp32 state tensors per parameter: Adam-like optimizers keep two moments, others one."""
    return 1 if target.rsplit(".", 1)[-1].lower() in _ONE_STATE else 2


def step_setup(
    cfg: RecipeConfig,
    layout: ResolvedLayout,
    *,
    stages: int = 1,
    on_gpu: bool | None = None,
    expert_load_factor: float = 1.0,
) -> StepSetup:
    """What `recipes train` would run for `cfg` on `layout` (`on_gpu`: the machine the run's
    defaults are resolved for, by `_dist_setup.resolve_machine_defaults` as the run does: FSDP2's
    mixed precision is bf16 on CUDA and none on CPU unless the YAML sets mp_policy; the strategy's
    memory terms are its `Strategy.memory_model`;
    `expert_load_factor`: the busiest EP rank's routed slots over the mean, a run-time fact)."""
    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    # the flags the YAML left to the machine, as the run on that machine resolves them
    d = resolve_machine_defaults(
        cfg.distributed, cuda=on_gpu, world_size=layout.world_size, param_dtype=cfg.model.dtype
    )
    strategy = get_strategy(d.strategy)
    storage = _elem(cfg.model.dtype, 4, key="model.dtype")
    compute = _elem(d.strategy_config.compute_dtype, storage, key="distributed.mp_policy.param_dtype")
    reduce = _elem(d.strategy_config.reduce_dtype, compute, key="distributed.mp_policy.reduce_dtype")
    kwargs = cfg.optimizer.kwargs
    impl = "fused" if kwargs.get("fused") else "loop" if kwargs.get("foreach") is False else "foreach"
    if kwargs.get("foreach") is None and not kwargs.get("fused") and not on_gpu:
        impl = "loop"  # torch picks foreach only for CUDA tensors
    ss = cfg.step_scheduler
    trainable = None
    if cfg.peft is not None:
        trainable = -1  # filled by the caller that knows the adapter sizes
    setup = StepSetup(
        sizes=tuple(layout.sizes().items()),
        sharding=strategy.memory_model(d.strategy_config),
        activation_checkpointing="activation_checkpointing" in d.strategy_config.enabled_layer_flags,
        seq_len=cfg.seq_length,
        local_batch=ss.local_batch_size,
        grad_accum=max(1, ss.global_batch_size // (ss.local_batch_size * batch_ranks(layout))),
        storage_bytes=storage,
        compute_bytes=compute,
        reduce_bytes=reduce,
        optimizer_states=optimizer_states(cfg.optimizer.target),
        optimizer_impl=impl,
        trainable_params=None if trainable is None else None,
        expert_load_factor=expert_load_factor,
        **_loss_fields(cfg, on_gpu=on_gpu, head_weight_readable=strategy.head_weight_readable),
    )
    # each parallelism's own fields (pp's schedule, ep's resharding, tp's sequence parallelism)
    own = {
        key: value
        for p in parallelisms()
        for key, value in p.step_fields(section=d, size=p.size(d, layout), stages=stages).items()
    }
    return setup.with_fields(own)


def _loss_fields(cfg: RecipeConfig, *, on_gpu: bool, head_weight_readable: bool) -> dict:
    """The chunked loss's chunk (`LinearCrossEntropy`) or nothing (full logits, as under a strategy
    whose head weight the loss cannot read: `Strategy.head_weight_readable`)."""
    if not is_linear_loss(cfg.loss_fn) or not head_weight_readable:
        return {}
    budget = CHUNK_ELEMENTS["accelerator" if on_gpu else "cpu"]
    return {"loss_chunk_elements": budget, "loss_chunk_tokens": getattr(cfg.loss_fn, "chunk_tokens", None)}
