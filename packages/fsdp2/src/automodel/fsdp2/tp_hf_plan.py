"""A model's own Hugging Face TP plan, translated to torch styles, plus the entries it leaves out
(parameterized activations and per-head norms between sharded linears)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

from automodel.fsdp2.tp_fqn import decoder_layers_prefix, fqn_matches, resolves_to_parameter
from automodel.fsdp2.tp_shared_styles import (
    RowwiseOwnedOutput,
    SharedTailParallel,
    replicated_on_sharded_width,
)
from automodel.fsdp2.tp_styles import SKIPPED_IN_HF_PLAN, TPPlan, translate_to_torch_parallel_style
from automodel.mesh.model_parts import head_dims, model_text_config

logger = logging.getLogger(__name__)


def get_hf_tp_shard_plan(model: nn.Module) -> TPPlan:
    """The model's own Hugging Face TP plan, translated to torch styles.

    Merges the class ``_tp_plan``, the inner base model's plan and ``config.base_model_tp_plan``
    (prefixed with ``base_model_prefix``), then the instance ``_tp_plan`` (transformers 5 fills it
    with the prefixed base plan and ``embedding_rowwise`` for untied embeddings). Expert/EP and
    packed styles are left out (those modules stay replicated), and so are keys for modules this
    instance does not have (variant entries of a generic plan). Raises ValueError if no plan exists.
    """
    raw: dict[str, str] = {}
    raw.update(getattr(type(model), "_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "") or ""
    inner = getattr(model, prefix, None) if prefix else None
    config = model_text_config(model)
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if isinstance(inner, nn.Module):
        base_plan.update(getattr(inner, "_tp_plan", None) or {})
        raw.update({f"{prefix}.{k}": v for k, v in base_plan.items()})
    else:
        # A wrapper without base_model_prefix (e.g. a pipeline stage holding `model.layers`): the
        # base plan is relative to the module that owns the decoder layers.
        found = decoder_layers_prefix(model)
        base = found[0].rpartition(".")[0] if found is not None else ""
        raw.update({f"{base}.{k}" if base else k: v for k, v in base_plan.items()})
    instance_plan = model.__dict__.get("_tp_plan") or {}
    raw.update(instance_plan)
    if not raw:
        raise ValueError(
            f"{type(model).__name__} has no Hugging Face tensor-parallel plan (_tp_plan / base_model_tp_plan)"
        )
    plan: TPPlan = {}
    modules = [n for n, _ in model.named_modules() if n]
    for key, style in raw.items():
        if style in SKIPPED_IN_HF_PLAN:
            logger.info("TP plan: leaving %s (%s) replicated", key, style)
            continue
        if resolves_to_parameter(model, key):
            logger.info("TP plan: %s names a parameter, not a module; left replicated", key)
            continue
        if not any(fqn_matches(key, n) for n in modules):
            # HF plans cover every variant of an architecture (e.g. Qwen3-MoE's dense `mlp.*_proj`
            # for `mlp_only_layers`); a key this instance has no module for is not an error.
            logger.info("TP plan: %s matches no module of this model; skipped", key)
            continue
        plan[key] = (
            _mla_kv_a_style(config) if style == "mla_kv_a_proj" else translate_to_torch_parallel_style(style)
        )
    plan.update(_activations_between(model, plan))
    plan.update(_head_norms_between(model, plan))
    return plan


def _mla_kv_a_style(config: object) -> ParallelStyle:
    """Multi-head latent attention's ``kv_a_proj_with_mqa`` ([latent | rope key shared by all heads]):
    replicated, with the rope key's gradient summed over tp (each rank's heads use it)."""
    width = getattr(config, "qk_rope_head_dim", None)
    if not isinstance(width, int) or width <= 0:
        raise ValueError(
            f"the plan style 'mla_kv_a_proj' needs config.qk_rope_head_dim, {type(config).__name__} has {width!r}"
        )
    return SharedTailParallel(width)


def _activations_between(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> TPPlan:
    """Plan entries for parameterized activations between a colwise and a rowwise linear.

    In a feed-forward block whose only linears are sharded (colwise in, rowwise out), a child with
    parameters that is not in the plan (xIELU's learned ``alpha_p``/``alpha_n``) runs on the
    width-sharded activation, so its parameter gradients are partial sums over tp: it is laid out
    by `replicated_on_sharded_width`. Only parameters that broadcast over the features qualify
    (one value per feature would have to be sharded instead); attention blocks are left alone.
    """
    extra: TPPlan = {}
    parents = {
        k.rpartition(".")[0] for k, v in plan.items() if type(v) in (RowwiseParallel, RowwiseOwnedOutput)
    }
    for parent_key in parents:
        children = {k.rpartition(".")[2]: v for k, v in plan.items() if k.rpartition(".")[0] == parent_key}
        if not any(type(v) is ColwiseParallel for v in children.values()):
            continue
        for name, parent in model.named_modules():
            if not fqn_matches(parent_key, name) or name.rpartition(".")[2].endswith(("attn", "attention")):
                continue
            unplanned = [(c, m) for c, m in parent.named_children() if c not in children]
            if any(isinstance(m, nn.Linear) for _, m in unplanned):
                continue  # a replicated linear in the block: its activations are not all sharded
            for child, module in unplanned:
                params = list(module.parameters())
                if params and all(p.dim() == 0 or p.shape[-1] == 1 for p in params):
                    extra[f"{parent_key}.{child}"] = replicated_on_sharded_width()
    return extra


def _keeps_heads_sharded(style: ParallelStyle) -> bool:
    """A colwise style whose output stays split over tp (not gathered back to every rank)."""
    return type(style) is ColwiseParallel and any(isinstance(p, Shard) for p in style.output_layouts)


def _head_norms_between(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> TPPlan:
    """Plan entries for per-head norms an attention block's plan leaves out.

    In an attention block whose projections are sharded by heads (colwise, output kept split), a child whose
    parameters are all one head_dim-wide vector shared by every head (a q/k norm the model's own
    plan omits because its config turns it off by default: GLM-4-MoE ``use_qk_norm``) runs on this
    rank's heads only, so its gradient is a partial sum over tp: it is laid out like Qwen3's
    q_norm (``replicated_with_grad_allreduce``).
    """
    widths = {(hd,) for hd in head_dims(model_text_config(model))}
    if not widths:
        return {}
    extra: TPPlan = {}
    parents = {k.rpartition(".")[0] for k, v in plan.items() if _keeps_heads_sharded(v)}
    for parent_key in parents:
        if not parent_key.rpartition(".")[2].endswith(("attn", "attention")):
            continue
        if any(
            type(v) is ColwiseParallel and not _keeps_heads_sharded(v)
            for k, v in plan.items()
            if k.rpartition(".")[0] == parent_key
        ):
            continue  # a gathered projection (MiniMax-M3's colwise_gather_output): every rank has all heads
        planned = {k.rpartition(".")[2] for k in plan if k.rpartition(".")[0] == parent_key}
        for name, parent in model.named_modules():
            if not fqn_matches(parent_key, name):
                continue
            for child, module in parent.named_children():
                params = list(module.parameters())
                if child in planned or not params or isinstance(module, nn.Linear):
                    continue
                if all(tuple(p.shape) in widths for p in params):
                    extra[f"{parent_key}.{child}"] = translate_to_torch_parallel_style(
                        "replicated_with_grad_allreduce"
                    )
    return extra
