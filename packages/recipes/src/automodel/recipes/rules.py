"""Rules that tie the layout to the model, data and batch sizes (sizes alone are checked in mesh)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from automodel.context_parallel import check_context_parallel_support
from automodel.fsdp2.tp_plan import check_plan_matches_model, check_plan_shards_every_layer, resolve_tp_plan
from automodel.mesh import ResolvedLayout
from automodel.mesh.model_parts import find_layer_list
from automodel.moe import check_expert_parallel_support, validate_moe_layout
from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.errors import ConfigError
from automodel.recipes.kernels.checks import check_kernels_rules
from automodel.recipes.model import build_meta_model, num_experts
from automodel.recipes.parallelisms import parallelisms
from automodel.recipes.parallelisms.pp import pipeline_stages as pipeline_stages

#: Outcomes of the model-dependent checks of one meta-device model, by what they depend on (the
#: error message, or None): `recipes plan` checks many layouts of one model and passes one memo.
ModelChecks = dict[tuple[Any, ...], str | None]


def _once(
    memo: ModelChecks | None,
    key: tuple[Any, ...],
    check: Callable[[], Any],
    *,
    errors: type[Exception] = ValueError,
) -> str | None:
    """The message of the `errors` `check` raises (None if it passes), run once per `key` of `memo`."""
    if memo is not None and key in memo:
        return memo[key]
    try:
        check()
        message = None
    except errors as e:
        message = str(e)
    if memo is not None:
        memo[key] = message
    return message


def check_model_supports_layout(
    cfg: RecipeConfig,
    layout: ResolvedLayout,
    hf_config: Any,
    *,
    model: Any = None,
    memo: ModelChecks | None = None,
) -> None:
    """The checks the ranks run when they apply TP, CP and the pipeline split, run once on the
    meta-device model before launch: a model a strategy cannot be applied to exactly is refused
    here, naming the model_type and why, instead of failing (or silently differing) in the ranks.

    `memo`: the outcomes for this `model` so far (each check depends on the model and a few flags,
    not on the sizes); None checks afresh."""
    d = cfg.distributed
    needs_pp_split = layout.pp > 1 and d.pipeline_config.module_fqns_per_model_part is None
    if not (layout.tp > 1 or layout.cp > 1 or layout.ep > 1 or needs_pp_split):
        return
    if model is None:  # callers that already hold the meta-device model pass it (built once per validate)
        model = build_meta_model(
            hf_config, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code
        )
    if layout.tp > 1:  # megatron_fsdp applies TP with the same plan rules (fsdp2's apply_tp)

        def check_tp() -> None:
            plan = resolve_tp_plan(model, tp_plan=d.tp_plan, sequence_parallel=d.sequence_parallel)
            check_plan_matches_model(model, plan)
            check_plan_shards_every_layer(model, plan)

        error = _once(memo, ("tp", repr(d.tp_plan), d.sequence_parallel), check_tp)
        if error is not None:
            raise ConfigError("distributed.tp_size", layout.tp, f"cannot be applied: {error}")
    if layout.cp > 1:
        error = _once(
            memo,
            ("cp", cfg.seq_length),
            lambda: check_context_parallel_support(model, seq_length=cfg.seq_length),
        )
        if error is not None:
            raise ConfigError("distributed.cp_size", layout.cp, f"cannot be applied: {error}")
    if layout.ep > 1:
        # automodel.moe's own rule (the one apply_ep enforces in the ranks), run on the meta model
        try:
            blocks = check_expert_parallel_support(model, declared_experts=num_experts(hf_config))
            validate_moe_layout(layout=layout, num_experts=[b.num_experts for b in blocks])
        except ValueError as e:
            raise ConfigError(
                "distributed.ep_size",
                layout.ep,
                f"cannot be applied: model_type {hf_config.model_type!r}: {e}",
            ) from None
    if needs_pp_split:
        # lazy: start-up, automodel.pipeline (torch pipelining) ~1.7 s, only with pp
        from automodel.pipeline import PipelineSplitError, validate_hf_model_for_pipeline_support

        error = _once(
            memo, ("pp",), lambda: validate_hf_model_for_pipeline_support(model), errors=PipelineSplitError
        )
        if error is not None:
            raise ConfigError("distributed.pp_size", layout.pp, f"cannot be applied: {error}")


def check_layout_rules(
    cfg: RecipeConfig,
    layout: ResolvedLayout,
    hf_config: Any,
    *,
    model: Any = None,
    memo: ModelChecks | None = None,
) -> None:
    """Every rule that ties the layout to the model, data and batch: heads vs tp, layers vs
    stages, experts vs ep, seq vs cp, batch, and what the model supports (`memo`: see
    `check_model_supports_layout`)."""
    d = cfg.distributed
    dp = layout.dp
    _check_streaming(cfg)
    for parallelism in parallelisms():  # each one's rules against the model and the batch
        parallelism.check_model(cfg=cfg, layout=layout, hf_config=hf_config, size=parallelism.size(d, layout))
    ss = cfg.step_scheduler
    if ss.global_batch_size % (ss.local_batch_size * dp):
        raise ConfigError(
            "step_scheduler.global_batch_size",
            ss.global_batch_size,
            f"must be a multiple of local_batch_size*dp = {ss.local_batch_size}*{dp} = {ss.local_batch_size * dp}",
        )
    if model is not None:
        _check_no_backward_recompute(model, hf_config, strategy=d.strategy)
        _check_per_layer_features(model, hf_config, cfg=cfg, layout=layout)
    check_model_supports_layout(cfg, layout, hf_config, model=model, memo=memo)

    check_kernels_rules(cfg, layout, hf_config, model=model)


#: What each per-layer flag does to a decoder layer (the flags are the strategy's `layer_flags`).
_PER_LAYER_VERBS = {
    "activation_checkpointing": "checkpoints",
    "enable_compile": "compiles",
    "enable_fsdp2_prefetch": "chains the prefetches of",
}


def _check_streaming(cfg: RecipeConfig) -> None:
    """A stream has no length: the run's length must be set, and it has no rows to cap."""
    if not getattr(type(cfg.dataset), "STREAMING", False):
        return
    if cfg.step_scheduler.max_steps is None:
        raise ConfigError(
            "step_scheduler.max_steps",
            None,
            "is required with dataset.source: streaming (a stream has no length)",
        )
    if cfg.packed_sequence.max_packs is not None:
        raise ConfigError(
            "packed_sequence.max_packs",
            cfg.packed_sequence.max_packs,
            "does not apply to a streaming dataset",
        )


def _check_per_layer_features(
    model: Any, hf_config: Any, *, cfg: RecipeConfig, layout: ResolvedLayout
) -> None:
    """Rule: the flags a strategy applies to each decoder layer (`Strategy.layer_flags`: activation
    checkpointing, per-layer compile, prefetch chains) act on the decoder layers, found by structure
    as every package finds them (GPT-2's ``transformer.h`` too); a model without a layer list is
    refused here rather than in the ranks."""
    d = cfg.distributed
    flags = list(d.strategy_config.enabled_layer_flags)
    if not flags:
        return
    # dense and MoE alike: the FSDP2 strategy applies these flags to `find_layer_list`'s layers
    if find_layer_list(model) is not None:
        return
    flag = flags[0]
    raise ConfigError(
        f"distributed.{flag}",
        True,
        f"{_PER_LAYER_VERBS.get(flag, 'applies to')} each decoder layer, but model_type "
        f"{hf_config.model_type!r} has no ModuleList of decoder layers; set it to false",
    )


def _check_no_backward_recompute(model: Any, hf_config: Any, *, strategy: str) -> None:
    """Rule: FSDP gathers a layer's parameters when the layer's forward runs, and DDP reduces each
    gradient when autograd produces it. Layers that rerun their sub-modules from inside a custom
    autograd backward (reversible residual layers, a ``backward_pass`` method: Reformer) meet
    sharded parameters there under FSDP and break DDP's reduction (measured: both fail)."""
    reversible = sorted(
        {type(m).__name__ for m in model.modules() if callable(getattr(m, "backward_pass", None))}
    )
    if reversible:
        raise ConfigError(
            "distributed.strategy",
            strategy,
            f"cannot train model_type {hf_config.model_type!r}: its layers {reversible} recompute their "
            "attention and feed-forward inside a custom autograd backward (reversible residual layers), "
            "where FSDP does not gather sharded parameters and DDP's gradient reduction does not run",
        )
