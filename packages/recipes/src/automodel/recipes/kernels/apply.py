"""`apply_kernels`: the ``kernels:`` and ``fp8:`` sections on the meta-device model, before any
parallelism; returns the start-up lines saying what was applied."""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from automodel.mesh import ResolvedLayout
from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.errors import ConfigError
from automodel.recipes.kernels.checks import liger_layout_refusal
from automodel.recipes.kernels.float8 import convert_to_fp8, describe_fp8
from automodel.recipes.kernels.liger import (
    FLCE,
    KEY,
    apply_liger_kernels,
    family_patches,
    liger_linear_cross_entropy_sum,
    liger_unavailable,
    resolve_patches,
)
from automodel.recipes.output_head import HeadLoss


def _liger(model: nn.Module, *, cfg: RecipeConfig, layout: ResolvedLayout, head_loss: HeadLoss) -> str:
    section = cfg.kernels
    model_type = cast(Any, model).config.model_type
    why = liger_unavailable() or liger_layout_refusal(cfg.distributed, layout)
    if why is None and not section.required and family_patches(model_type) is None:
        why = f"Liger has no kernels for model_type {model_type!r}"
    if why is not None:
        if section.required:  # refused before launch already; a Python API caller meets it here
            raise ConfigError(KEY, section.liger, why)
        return f"kernels.liger: auto (AutoModel's model.use_liger_kernel): not applied: {why}"
    chunked = None if head_loss.plan.chunked else head_loss.plan.reason
    patches = resolve_patches(section, model_type=model_type, chunked_head=chunked)
    apply_liger_kernels(model, patches=patches)
    if FLCE in patches:
        head_loss.linear_loss = liger_linear_cross_entropy_sum
        head_loss.linear_loss_name = "Liger's fused linear cross-entropy (replaces the chunked one)"
    return f"kernels.liger: {', '.join(patches)} on model_type {model_type!r}"


def apply_kernels(
    model: nn.Module, *, cfg: RecipeConfig, layout: ResolvedLayout, head_loss: HeadLoss
) -> list[str]:
    """Liger's kernels then the float8 conversion on `model` (meta device, before parallelism), as
    ``cfg.kernels`` / ``cfg.fp8`` ask; `head_loss` takes Liger's fused linear CE when selected, and
    its head stays out of float8. Returns the start-up lines."""
    lines = []
    if cfg.kernels.enabled:
        lines.append(_liger(model, cfg=cfg, layout=layout, head_loss=head_loss))
    if cfg.fp8.enabled:
        keep = (head_loss.plan.fqn,) if head_loss.plan.fqn is not None else ()
        converted = convert_to_fp8(model, section=cfg.fp8, keep=keep)
        lines.append(describe_fp8(model, section=cfg.fp8, converted=converted))
    return lines


def check_linear_loss_bound(head_loss: HeadLoss) -> None:
    """After `HeadLoss.bind`: a layout that made the head its own FSDP unit keeps the full logits,
    which Liger's fused linear CE (selected) cannot replace: refused, not dropped."""
    if head_loss.linear_loss is liger_linear_cross_entropy_sum and not head_loss.plan.chunked:
        raise ConfigError(KEY, FLCE, f"cannot replace the loss in this layout ({head_loss.plan.reason})")
