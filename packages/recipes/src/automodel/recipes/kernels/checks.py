"""What `kernels:` and `fp8:` refuse before launch: the machine (`check_kernels_environment`) and
the model and layout (`check_kernels_rules`). ``kernels.liger: auto`` is never refused: the ranks
say in one line why it was not applied (`apply.apply_kernels`)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from torch import nn

from automodel.mesh import ResolvedLayout
from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.errors import ConfigError
from automodel.recipes.kernels.float8 import fp8_unavailable
from automodel.recipes.kernels.liger import KEY, liger_unavailable, resolve_patches
from automodel.recipes.loss import masked_cross_entropy_sum
from automodel.recipes.output_head import build_head_loss
from automodel.recipes.parallelisms import parallelisms
from automodel.recipes.parallelisms.base import KernelKind
from automodel.recipes.strategies import get_strategy, strategy_names

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from automodel.recipes.config.distributed import DistributedSection


def check_kernels_environment(cfg: RecipeConfig) -> None:
    """`ConfigError` naming the key when this machine cannot run the requested kernels or float8."""
    if cfg.kernels.required and (why := liger_unavailable()):
        raise ConfigError(KEY, _shown(cfg.kernels.liger), why)
    if cfg.fp8.enabled and (refusal := fp8_unavailable(cfg.fp8)):
        raise ConfigError(refusal[0], True, refusal[1])


def kernel_layout_refusal(
    kernel: KernelKind, *, section: DistributedSection, layout: ResolvedLayout
) -> str | None:
    """Why `kernel` is not applied in this layout: the first parallelism in use that does not
    compose with it (`Parallelism.kernel_refusal`), named with its size key; None when all do."""
    for parallelism in parallelisms():
        size = parallelism.size(section, layout)
        if parallelism.in_use(size) and (refusal := parallelism.kernel_refusal(kernel)):
            what, why = refusal
            return f"is not wired with {what} (distributed.{parallelism.size_key}={size}): {why}"
    return None


def liger_layout_refusal(section: DistributedSection, layout: ResolvedLayout) -> str | None:
    """Why Liger's kernels are not applied in this layout (None: they are)."""
    return kernel_layout_refusal("liger", section=section, layout=layout)


def chunked_head_refusal(cfg: RecipeConfig, model: nn.Module) -> str | None:
    """Why this run's loss does not read the head's weight (None: the chunked path is used)."""
    name = cfg.distributed.strategy
    if not get_strategy(name).head_weight_readable:
        return f"distributed.strategy {name} keeps the full logits"

    plan = build_head_loss(cfg.loss_fn, model=model, logits_loss=masked_cross_entropy_sum).plan
    return None if plan.chunked else plan.reason


def check_kernels_rules(
    cfg: RecipeConfig, layout: ResolvedLayout, hf_config: PretrainedConfig, *, model: nn.Module | None = None
) -> None:
    """`ConfigError` naming the key when the model or layout cannot take the requested kernels
    (the fused linear CE's head is checked when `model`, the meta-device model, is given)."""
    section = cfg.kernels
    if section.required:
        why = liger_layout_refusal(cfg.distributed, layout)
        if why:
            raise ConfigError(KEY, _shown(section.liger), why)
        if importlib.util.find_spec("liger_kernel") is not None:  # else check_kernels_environment says so
            head = chunked_head_refusal(cfg, model) if model is not None else None
            resolve_patches(section, model_type=hf_config.model_type, chunked_head=head)
    fp8 = cfg.fp8
    if not fp8.enabled:
        return
    if why := kernel_layout_refusal("float8", section=cfg.distributed, layout=layout):
        raise ConfigError("fp8.enabled", True, why)
    if cfg.peft is not None:
        raise ConfigError(
            "fp8.enabled", True, "is not wired with peft (LoRA's frozen base weights); remove one"
        )
    strategy = get_strategy(cfg.distributed.strategy)
    if not strategy.float8_linears:
        able = " or ".join(n for n in strategy_names() if get_strategy(n).float8_linears)
        raise ConfigError(
            "fp8.enabled", True, f"is not wired with distributed.strategy {strategy.name}; use {able}"
        )
    if fp8.enable_fsdp_float8_all_gather and not strategy.float8_all_gather:
        raise ConfigError(
            "fp8.enable_fsdp_float8_all_gather",
            True,
            f"is an FSDP2 option; distributed.strategy is {cfg.distributed.strategy}",
        )


def _shown(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
