"""How evenly routing spreads the rows over the ep ranks, as the dispatches of a stretch of steps saw it.

The busiest ep rank computes the most expert rows and holds the most expert activations, so its
share sets the step's time and peak memory. `ExpertLoad` counts, while active, the rows every
dispatch of this rank sends and receives; `load_factor` is the busiest rank's received rows over
the mean (1: perfectly balanced; at most ep: one rank got every row).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_ACTIVE: list[ExpertLoad] = []


class ExpertLoad:
    """Context manager counting this rank's dispatched rows: ``with ExpertLoad() as load: ...``."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0

    def __enter__(self) -> ExpertLoad:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)

    def load_factor(self, *, group: dist.ProcessGroup | None = None) -> float:
        """The busiest rank of `group` (the ep group)'s received rows over the group's mean; a
        collective: every rank of `group` calls it."""
        ep = dist.get_world_size(group)
        total = torch.tensor([float(self.sent)], dtype=torch.float64)
        busiest = torch.tensor([float(self.received)], dtype=torch.float64)
        dist.all_reduce(total, group=group)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=group)
        return float(busiest / (total / ep)) if total.item() else 1.0


def record_dispatch(*, sent: int, received: int) -> None:
    """Called by every dispatch: add its rows to each active `ExpertLoad`."""
    for load in _ACTIVE:
        load.sent += sent
        load.received += received
