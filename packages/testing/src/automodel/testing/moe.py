"""The tiny MoE models of the expert-parallel tests and benchmarks: the shared builder
(`automodel.testing.tiny_model`) with what these tests need on top (transformers imported lazily).

On top of the shared tiny sizes: 8 experts by default (ep = 2, 4 and 8 split them evenly), the
router's auxiliary loss in the output (its parity is part of the check), Qwen3-MoE's normalised
top-k, positions up to 128.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from automodel.testing.tiny_model import MOE_FAMILIES, moe_fields, tiny_causal_lm

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["MOE_FAMILIES", "build_tiny_model", "preload"]


def build_tiny_model(
    family: str,
    *,
    seed: int = 0,
    num_experts: int = 8,
    top_k: int = 2,
    layers: int = 2,
    hidden: int = 64,
    expert_intermediate: int = 32,
    aux_loss_coef: float = 0.01,
) -> PreTrainedModel:
    """A seeded fp32 causal LM of `family` (one of `MOE_FAMILIES`, or the dense "llama"), identical
    on every rank for the same seed; the dense MLPs are 2 * `hidden` wide."""
    overrides: dict[str, object] = {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": 128,
    }
    if family in MOE_FAMILIES:
        overrides |= moe_fields(family, experts=num_experts, top_k=top_k, expert_width=expert_intermediate)
        overrides |= {"router_aux_loss_coef": aux_loss_coef, "output_router_logits": True}
        if family == "qwen3_moe":
            overrides["norm_topk_prob"] = True
    elif family != "llama":
        raise ValueError(f"family must be one of {(*MOE_FAMILIES, 'llama')}, got {family!r}")
    return tiny_causal_lm(family, layers=layers, seed=seed, **overrides)


def preload(families: tuple[str, ...] = (*MOE_FAMILIES, "llama")) -> None:
    """Import the modeling modules and torch's lazily imported parts once, before ranks are forked.

    Otherwise every forked rank imports them itself, which on a small machine costs far more
    than the test.
    """
    # lazy: start-up, torch._dynamo + fsdp ~2.3 s, preloaded only on request
    import torch._dynamo  # noqa: F401  (FSDP2 and checkpoint import it lazily)
    import torch.distributed.fsdp  # noqa: F401

    for family in families:
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
