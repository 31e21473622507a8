"""Rules that tie the layout to the model, data and batch sizes (sizes alone are checked in mesh)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from automodel.mesh import ResolvedLayout
from automodel.mesh.model_parts import find_layer_list
from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.errors import ConfigError
from automodel.recipes.kernels.checks import check_kernels_rules
from automodel.recipes.model import build_meta_model
from automodel.recipes.parallelisms import batch_ranks, parallelisms
from automodel.recipes.parallelisms.base import ModelChecks as ModelChecks
from automodel.recipes.parallelisms.pp import pipeline_stages as pipeline_stages

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_model_supports_layout(
    cfg: RecipeConfig,
    layout: ResolvedLayout,
    hf_config: PretrainedConfig,
    *,
    model: nn.Module | None = None,
    memo: ModelChecks | None = None,
) -> None:
    """Every registered parallelism's check of the meta-device model (`Parallelism.check_meta_model`:
    the check its package runs when the ranks apply it), run once before launch: a model a layout
    cannot be applied to exactly is refused here, naming the model_type and why, instead of failing
    (or silently differing) in the ranks. `model`: the meta-device model when the caller holds it
    (else built on the first check that needs it); `memo`: the outcomes for this model so far (each
    check depends on the model and a few flags, not on the sizes); None checks afresh."""
    built: list[nn.Module] = [] if model is None else [model]

    def meta_model() -> nn.Module:
        if not built:
            built.append(
                build_meta_model(
                    hf_config, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code
                )
            )
        return built[0]

    for parallelism in parallelisms():
        parallelism.check_meta_model(
            cfg=cfg,
            layout=layout,
            hf_config=hf_config,
            size=parallelism.size(cfg.distributed, layout),
            meta_model=meta_model,
            memo=memo,
        )


def check_layout_rules(
    cfg: RecipeConfig,
    layout: ResolvedLayout,
    hf_config: PretrainedConfig,
    *,
    model: nn.Module | None = None,
    memo: ModelChecks | None = None,
) -> None:
    """Every rule that ties the layout to the model, data and batch: heads vs tp, layers vs
    stages, experts vs ep, seq vs cp, batch, and what the model supports (`memo`: see
    `check_model_supports_layout`)."""
    d = cfg.distributed
    rows = batch_ranks(layout)  # the ranks that split each batch's rows (`mesh_roles`)
    _check_streaming(cfg)
    for parallelism in parallelisms():  # each one's rules against the model and the batch
        parallelism.check_model(cfg=cfg, layout=layout, hf_config=hf_config, size=parallelism.size(d, layout))
    ss = cfg.step_scheduler
    if ss.global_batch_size % (ss.local_batch_size * rows):
        raise ConfigError(
            "step_scheduler.global_batch_size",
            ss.global_batch_size,
            f"must be a multiple of local_batch_size*dp = {ss.local_batch_size}*{rows} = {ss.local_batch_size * rows}",
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
    model: nn.Module, hf_config: PretrainedConfig, *, cfg: RecipeConfig, layout: ResolvedLayout
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


def _check_no_backward_recompute(model: nn.Module, hf_config: PretrainedConfig, *, strategy: str) -> None:
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
