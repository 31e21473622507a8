"""Liger's Triton kernels on a Hugging Face model, through Liger's own patching API.

`apply_liger_kernels` calls ``liger_kernel.transformers._apply_liger_kernel_to_instance`` (which
dispatches to ``apply_liger_kernel_to_<model_type>``) on the meta-device model before any
parallelism: RMSNorm / SwiGLU / GeGLU / LayerNorm modules get Liger's forwards, RoPE is replaced
in the family's modeling module. Liger's API patches the modeling module for the whole process
(every model of that family built afterwards in it uses the kernels too), and it skips silently what
a family lacks: the patches are resolved against the family first and checked afterwards here.

Liger's fused linear cross-entropy is not patched into the model's forward (the loop never passes
labels to the model): selected, it replaces this project's chunked loss inside the same head-loss
path (`output_head.HeadLoss`), on the hidden states the head records and the head's weight.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn

from automodel.recipes.config.kernels import LIGER_PATCHES, KernelsSection
from automodel.recipes.errors import ConfigError

KEY = "kernels.liger"
FLCE = "fused_linear_cross_entropy"
INSTALL = "pip install 'automodel-recipes[kernels]'"
#: the `_get_name()` each module patch gives the modules it patched (Liger's own names)
_MODULE_NAMES = {"rms_norm": "RMSNorm", "swiglu": "MLP", "geglu": "GEGLUMLP", "layer_norm": "LayerNorm"}


def liger_unavailable() -> str | None:
    """Why Liger's kernels cannot run on this machine (None: they can)."""
    if not torch.cuda.is_available():
        return "Liger's kernels are Triton GPU kernels and this machine has no CUDA device"
    try:
        importlib.import_module("liger_kernel.transformers")
    except ImportError as e:
        return f"the liger-kernel package is not importable ({e}); {INSTALL}"
    return None


def family_patches(model_type: str) -> tuple[str, ...] | None:
    """The patches of `LIGER_PATCHES` that Liger has for `model_type` (None: no Liger support)."""
    # lazy: optional dependency (liger-kernel)
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply_fn is None:
        return None
    params = inspect.signature(apply_fn).parameters
    return tuple(p for p in LIGER_PATCHES if p in params)


def resolve_patches(section: KernelsSection, *, model_type: str, chunked_head: str | None) -> tuple[str, ...]:
    """The Liger patches to apply to `model_type` (`ConfigError` naming ``kernels.liger`` when a
    requested one cannot be). ``true`` / ``auto``: every one the family has, the fused linear CE only
    where the loss reads the head's weight (`chunked_head`: its reason otherwise)."""
    if not section.enabled:
        return ()
    offered = family_patches(model_type)
    if offered is None:
        # lazy: optional dependency (liger-kernel)
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        raise ConfigError(
            KEY,
            section.liger,
            f"Liger has no kernels for model_type {model_type!r} (it patches "
            f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))})",
        )
    if not isinstance(section.liger, tuple):  # true / auto: all the family has
        return tuple(p for p in offered if p != FLCE or chunked_head is None)
    for name in section.liger:
        if name not in offered:
            raise ConfigError(
                KEY,
                list(section.liger),
                f"Liger's patch for model_type {model_type!r} has no {name!r} (it offers {', '.join(offered)})",
            )
    if FLCE in section.liger and chunked_head is not None:
        raise ConfigError(
            KEY,
            list(section.liger),
            f"{FLCE} replaces the chunked linear cross-entropy, which this run does not use ({chunked_head})",
        )
    return section.liger


@dataclass
class ModelingPatch:
    """The globals of a family's modeling module that Liger replaced, with their previous values:
    `undo` restores them (a process that builds other models of the family afterwards, e.g. the
    next benchmark variant or test; a training run keeps them)."""

    module: ModuleType | None = None
    previous: dict[str, Any] = field(default_factory=dict)

    def undo(self) -> None:
        for name, value in self.previous.items():
            setattr(self.module, name, value)


def apply_liger_kernels(model: nn.Module, *, patches: tuple[str, ...]) -> ModelingPatch:
    """Patch `model` (any device, meta included) with Liger's kernels for `patches` through
    ``_apply_liger_kernel_to_instance``; returns what it replaced in the family's modeling module.
    RuntimeError when a requested patch left the model unchanged (never a silent no-op)."""
    # lazy: optional dependency (liger-kernel)
    from liger_kernel.transformers import monkey_patch

    module_patches = [p for p in patches if p != FLCE]
    if not module_patches:
        return ModelingPatch()
    flags: dict[str, Any] = {p: p in patches for p in LIGER_PATCHES if p != FLCE}
    flags.update(cross_entropy=False, fused_linear_cross_entropy=False)  # the loss is ours (HeadLoss)
    modeling = sys.modules[type(model).__module__]
    before = dict(vars(modeling))
    monkey_patch._apply_liger_kernel_to_instance(model=model, **flags)
    replaced = ModelingPatch(
        modeling, {k: before.get(k) for k, v in vars(modeling).items() if before.get(k) is not v}
    )
    names = [m._get_name() for m in model.modules()]
    for patch in module_patches:
        if patch == "rope":
            done = any("rotary" in k or "rope" in k.lower() for k in replaced.previous)
        else:
            done = any(n.startswith("Liger") and n.endswith(_MODULE_NAMES[patch]) for n in names)
        if not done:
            raise RuntimeError(
                f"{KEY}: Liger's patch for model_type {cast(Any, model).config.model_type!r} did not apply {patch!r}"
            )
    return replaced


def liger_linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """`linear_ce.linear_cross_entropy_sum`'s contract through Liger's fused kernel: the sum of
    token CE of ``softcap(scale * (hidden @ weight.T + bias))`` over labels != -100, fp32
    accumulation. `chunk_tokens` is not used (Liger sizes its own chunks); a logit scale is folded
    into the hidden states and the bias (the logits are linear in both)."""
    # lazy: optional dependency (liger-kernel)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    del chunk_tokens
    flat = hidden.reshape(-1, hidden.shape[-1])
    if scale is not None:
        flat = flat * scale
        bias = None if bias is None else bias * scale
    loss = liger_fused_linear_cross_entropy(
        flat,
        weight,
        labels.reshape(-1),
        bias=bias,
        ignore_index=-100,
        reduction="sum",
        softcap=softcap,
        accum_dtype=torch.float32,
    )
    return cast(torch.Tensor, loss)  # only the loss without z-loss / accuracy outputs
