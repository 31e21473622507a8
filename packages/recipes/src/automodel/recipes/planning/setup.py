"""A recipe config and its resolved layout -> the `StepSetup` the memory estimate reads."""

from __future__ import annotations

from typing import Any

import torch

from automodel.mesh import ResolvedLayout, parse_dtype
from automodel.recipes.planning.memory import StepSetup

_ONE_STATE = ("sgd", "adagrad", "rmsprop")


def _elem(dtype: Any, default: int, *, key: str) -> int:
    """Bytes per element of a dtype or dtype name (every spelling `parse_dtype` accepts)."""
    parsed = parse_dtype(dtype, key=key)
    return default if parsed is None else torch.empty((), dtype=parsed).element_size()


def optimizer_states(target: str) -> int:
    """fp32 state tensors per parameter: Adam-like optimizers keep two moments, others one."""
    return 1 if target.rsplit(".", 1)[-1].lower() in _ONE_STATE else 2


def _flag(section: Any, name: str, default: Any) -> Any:
    """A strategy flag of the built strategy config (`default` for a strategy without it)."""
    return getattr(section.strategy_config, name, default)


def step_setup(
    cfg: Any,
    layout: ResolvedLayout,
    *,
    stages: int = 1,
    on_gpu: bool | None = None,
    expert_load_factor: float = 1.0,
) -> StepSetup:
    """What `recipes train` would run for `cfg` on `layout` (`on_gpu`: the machine the run's
    defaults are resolved for, see `_dist_setup.resolve_machine_defaults`: FSDP2's mixed
    precision is bf16 on CUDA and none on CPU unless the YAML sets mp_policy;
    `expert_load_factor`: the busiest EP rank's routed slots over the mean, a run-time fact)."""
    d = cfg.distributed
    storage = _elem(cfg.model.dtype, 4, key="model.dtype")
    # the YAML's policy; one it left to the machine is decided by on_gpu below
    mp = None if "mp_policy" in d.machine_keys else getattr(d.strategy_config, "mp_policy", None)
    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    if mp is None and on_gpu and d.strategy == "fsdp2":
        compute, reduce = 2, 4
    else:
        compute = _elem(getattr(mp, "param_dtype", None), storage, key="distributed.mp_policy.param_dtype")
        reduce = _elem(getattr(mp, "reduce_dtype", None), compute, key="distributed.mp_policy.reduce_dtype")
    kwargs = cfg.optimizer.kwargs
    impl = "fused" if kwargs.get("fused") else "loop" if kwargs.get("foreach") is False else "foreach"
    if kwargs.get("foreach") is None and not kwargs.get("fused") and not on_gpu:
        impl = "loop"  # torch picks foreach only for CUDA tensors
    ss = cfg.step_scheduler
    pipe = d.pipeline_config
    trainable = None
    if cfg.peft is not None:
        trainable = -1  # filled by the caller that knows the adapter sizes
    return StepSetup(
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        ep=layout.ep,
        dp_shard=layout.dp_shard,
        dp_replicate=layout.dp_replicate,
        strategy=d.strategy,
        sequence_parallel=bool(_flag(d, "sequence_parallel", False)),
        activation_checkpointing=bool(_flag(d, "activation_checkpointing", False)),
        seq_len=cfg.seq_length,
        local_batch=ss.local_batch_size,
        grad_accum=max(1, ss.global_batch_size // (ss.local_batch_size * layout.dp)),
        pp_microbatch=pipe.pp_microbatch_size if pipe is not None else 1,
        pp_schedule=pipe.pp_schedule if pipe is not None else "1f1b",
        stages_per_rank=max(1, stages // layout.pp) if layout.pp > 1 else 1,
        storage_bytes=storage,
        compute_bytes=compute,
        reduce_bytes=reduce,
        optimizer_states=optimizer_states(cfg.optimizer.target),
        optimizer_impl=impl,
        defer_grad_sync=d.strategy == "fsdp2" and bool(_flag(d, "defer_fsdp_grad_sync", True)),
        trainable_params=None if trainable is None else None,
        reshard_after_forward=bool(d.moe_config.reshard_after_forward) if layout.ep > 1 else None,
        megatron_zero=int(_flag(d, "zero_dp_strategy", 3)),
        megatron_grad_fp32=bool(_flag(d, "grad_reduce_in_fp32", False)),
        megatron_master_fp32=bool(_flag(d, "preserve_fp32_weights", False)),
        expert_load_factor=expert_load_factor,
        **_loss_fields(cfg, on_gpu=on_gpu),
    )


def _loss_fields(cfg: Any, *, on_gpu: bool) -> dict:
    """The chunked loss's chunk (`LinearCrossEntropy`) or nothing (full logits); megatron_fsdp keeps
    full logits (`Trainer._build_head_loss`)."""
    from automodel.recipes.linear_ce import CHUNK_ELEMENTS
    from automodel.recipes.output_head import is_linear_loss

    if not is_linear_loss(cfg.loss_fn) or cfg.distributed.strategy == "megatron_fsdp":
        return {}
    budget = CHUNK_ELEMENTS["accelerator" if on_gpu else "cpu"]
    return {"loss_chunk_elements": budget, "loss_chunk_tokens": getattr(cfg.loss_fn, "chunk_tokens", None)}
