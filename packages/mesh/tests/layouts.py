"""Enumerate every legal layout of a world size (shared by the mesh tests)."""

from __future__ import annotations

from itertools import product

from automodel.mesh import ParallelismSizes


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def legal_layouts(world_size: int, *, with_ep: bool = True) -> list[ParallelismSizes]:
    """Every (tp, pp, cp, dp_replicate, ep) mix that resolves for `world_size` ranks."""
    out = []
    for tp, pp, cp in product(divisors(world_size), repeat=3):
        if world_size % (tp * pp * cp):
            continue
        dp = world_size // (tp * pp * cp)
        for rep in divisors(dp):
            if rep > 1 and rep == dp:
                continue
            for ep in divisors(dp * cp) if with_ep else [1]:
                out.append(
                    ParallelismSizes(
                        tp_size=tp,
                        pp_size=pp,
                        cp_size=cp,
                        dp_replicate_size=rep if rep > 1 else None,
                        ep_size=ep,
                    )
                )
    return out
