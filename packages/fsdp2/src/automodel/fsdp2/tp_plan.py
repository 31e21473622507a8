"""Tensor-parallel plan resolution: which plan `apply_tp` applies.

Resolution order (`resolve_tp_plan`): an explicit plan (dict, or import path of a dict or of a
function returning one) -> the model's own Hugging Face plan (`get_hf_tp_shard_plan`) -> a
Llama-style default built from the module names the model actually has. With sequence parallel
and no explicit plan the Llama-style SP plan is used, and the HF plan is skipped (HF plans carry
no SP entries). Modules holding tied weights stay replicated.

The concepts live in their own modules (`tp_styles`, `tp_fqn`, `tp_hf_plan`, `tp_llama_plan`,
`tp_checks`, `tp_lora`); their public names are re-exported here. Reused by the megatron-fsdp
adapter; depends on torch only (transformers is never imported).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from automodel.fsdp2.tp_checks import (
    check_plan_matches_model,
    check_plan_shards_every_layer,
    check_sequence_parallel_applies,
    validate_tp_mesh,
)
from automodel.fsdp2.tp_fqn import fqn_matches
from automodel.fsdp2.tp_hf_plan import get_hf_tp_shard_plan
from automodel.fsdp2.tp_llama_plan import default_llama_tp_plan
from automodel.fsdp2.tp_lora import has_lora_adapter, with_lora_adapters
from automodel.fsdp2.tp_styles import (
    LAYOUT_ONLY_STYLES,
    TPPlan,
    plan_has_sequence_parallel,
    translate_to_torch_parallel_style,
)
from automodel.fsdp2.utils import import_class_from_path
from automodel.mesh.model_parts import (
    model_text_config,
    tied_weight_modules,
)

logger = logging.getLogger(__name__)


def explicit_plan(tp_plan: Mapping[str, Any] | str) -> TPPlan:
    """A user's plan (dict of FQN -> style or style string, or the import path of a dict or of a
    function returning one) as torch styles; ValueError for anything else."""
    if isinstance(tp_plan, str):
        obj = import_class_from_path(tp_plan)
        if callable(obj) and not isinstance(obj, Mapping):
            obj = obj()
        if not isinstance(obj, Mapping):
            raise ValueError(
                f"tp_plan {tp_plan!r} must name a dict or a function returning one, got {type(obj).__name__}"
            )
        tp_plan = obj
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        raise ValueError(f"tp_plan must be a non-empty dict of module name -> style, got {tp_plan!r}")
    plan: TPPlan = {}
    for key, style in tp_plan.items():
        if isinstance(style, str):
            style = translate_to_torch_parallel_style(style)
        if not isinstance(style, ParallelStyle):
            raise ValueError(f"tp_plan[{key!r}] must be a ParallelStyle or a style string, got {style!r}")
        plan[key] = style
    return plan


def _drop_tied(plan: TPPlan, model: nn.Module, *, explicit: bool) -> TPPlan:
    """Leave the modules holding tied weights out of the plan: TP would shard such a weight once
    per owner (rowwise in the embedding, colwise in the head) and so untie it, each owner training
    its own copy, silently unlike one process."""
    tied = tied_weight_modules(model)
    hits = [
        key
        for key, style in plan.items()
        if not isinstance(style, LAYOUT_ONLY_STYLES) and any(fqn_matches(key, name) for name in tied)
    ]
    if hits and explicit:
        raise ValueError(
            f"tp_plan shards {hits}, which hold weights tied to another module ({sorted(tied)}); "
            "sharding them would untie the weights. Leave them out of the plan (they stay replicated "
            "over tp) or build the model with tie_word_embeddings=False"
        )
    for key in hits:
        logger.info("TP plan: leaving %s replicated (its weight is tied to another module)", key)
    return {k: v for k, v in plan.items() if k not in hits}


def _require_declared_tp_support(model: nn.Module) -> None:
    """The automatic plans need a model whose attention is written for sharded heads, which a
    Hugging Face model declares with a tensor-parallel plan (``base_model_tp_plan``); a model
    without one may hard-code the head count and would crash or, worse, compute something else."""
    config = model_text_config(model)
    if getattr(config, "base_model_tp_plan", None):
        return
    raise ValueError(
        f"model_type {getattr(config, 'model_type', type(model).__name__)!r} declares no tensor-parallel plan "
        "(config.base_model_tp_plan), so its attention is not known to work with sharded heads; give an "
        "explicit tp_plan"
    )


def resolve_tp_plan(
    model: nn.Module, *, tp_plan: Mapping[str, Any] | str | None = None, sequence_parallel: bool = False
) -> TPPlan:
    """The TP plan to apply: explicit -> the model's HF plan -> Llama-style default (see module doc).

    Modules holding tied weights stay replicated over tp (an explicit plan that shards them is a
    ValueError): the tie, and so the single-process math, is kept.
    """
    if tp_plan is not None:
        return _drop_tied(explicit_plan(tp_plan), model, explicit=True)
    _require_declared_tp_support(model)
    if sequence_parallel:
        plan = default_llama_tp_plan(model, sequence_parallel=True)
        check_sequence_parallel_applies(model)
        return _drop_tied(plan, model, explicit=False)
    try:
        plan = get_hf_tp_shard_plan(model)
    except ValueError:
        plan = {}
    if not plan:
        plan = default_llama_tp_plan(model, sequence_parallel=False)
    return _drop_tied(plan, model, explicit=False)


__all__ = [
    "TPPlan",
    "check_plan_matches_model",
    "check_plan_shards_every_layer",
    "default_llama_tp_plan",
    "explicit_plan",
    "get_hf_tp_shard_plan",
    "has_lora_adapter",
    "plan_has_sequence_parallel",
    "resolve_tp_plan",
    "tied_weight_modules",
    "translate_to_torch_parallel_style",
    "validate_tp_mesh",
    "with_lora_adapters",
]
