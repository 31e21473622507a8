"""Explicit FSDP2 prefetch chains: which units each unit all-gathers ahead of time."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from automodel.fsdp2.activation_checkpointing import get_lm_ac_layers


def apply_fsdp2_prefetch(
    model: nn.Module, *, forward_depth: int = 1, backward_depth: int = 2
) -> dict[str, dict[str, list[int]]]:
    """Chain the FSDP2 decoder layers: layer i prefetches i+1..i+fd forward and i-1..i-bd backward.

    The root prefetches the first `forward_depth` layers in forward and the last
    `backward_depth` layers in backward. A prefetched layer brings the units nested in it along
    (expert-parallel experts: their token dispatch syncs with the host, which would hold back
    FSDP2's implicit prefetch, as torchtitan notes). Returns the chain as layer indices (root =
    -1), for logs.
    """
    for name, value in (("forward_depth", forward_depth), ("backward_depth", backward_depth)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    layers = [m for m in get_lm_ac_layers(model) if isinstance(m, FSDPModule)]
    if not layers:
        raise ValueError(
            "prefetch needs FSDP2-sharded decoder layers; call apply_fsdp2_sharding_recursively first"
        )
    n = len(layers)
    nested = [
        [m for m in layer.modules() if m is not layer and isinstance(m, FSDPModule)] for layer in layers
    ]

    def units(indices: list[int]) -> list[FSDPModule]:
        return [unit for j in indices for unit in (layers[j], *nested[j])]

    forward: dict[int, list[int]] = {}
    backward: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        fwd = list(range(i + 1, min(n, i + 1 + forward_depth)))
        bwd = list(range(i - 1, max(-1, i - 1 - backward_depth), -1))
        if fwd:
            layer.set_modules_to_forward_prefetch(units(fwd))
        if bwd:
            layer.set_modules_to_backward_prefetch(units(bwd))
        forward[i], backward[i] = fwd, bwd
    if isinstance(model, FSDPModule):
        forward[-1] = list(range(min(n, forward_depth)))
        backward[-1] = list(range(n - 1, max(-1, n - 1 - backward_depth), -1))
        model.set_modules_to_forward_prefetch(units(forward[-1]))
        model.set_modules_to_backward_prefetch(units(backward[-1]))
    return {
        "forward": {str(k): v for k, v in forward.items()},
        "backward": {str(k): v for k, v in backward.items()},
    }
