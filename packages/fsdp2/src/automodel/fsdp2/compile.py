"""Per-layer ``torch.compile`` (in place, so state-dict keys get no ``_orig_mod`` prefix)."""

from __future__ import annotations

from torch import nn

from automodel.fsdp2.activation_checkpointing import get_lm_ac_layers


def apply_compile(
    model: nn.Module, *, backend: str = "inductor", fullgraph: bool = False, dynamic: bool | None = None
) -> int:
    """Compile each decoder layer with ``nn.Module.compile``; returns the number compiled.

    Per-layer compile keeps compile time flat in depth and composes with FSDP2 (applied after).
    """
    layers = get_lm_ac_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no ModuleList of decoder layers to compile")
    for layer in layers:
        layer.compile(backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    return len(layers)
