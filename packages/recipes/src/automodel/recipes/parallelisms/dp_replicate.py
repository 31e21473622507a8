"""Replicated data parallelism (HSDP's outer dim): ``distributed.dp_replicate_size`` copies of the
dp_shard-sharded model, gradients all-reduced across them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from automodel.mesh import dense_axes
from automodel.recipes.parallelisms.base import Parallelism, PlanColumn, SearchPoint, divisors

if TYPE_CHECKING:
    from automodel.recipes.planning.step import StepTraffic


class DataParallelReplicate(Parallelism[None]):
    """Any value set asks for it (even 1): strategies without HSDP refuse the key itself."""

    name = "dp_replicate"
    size_key = "dp_replicate_size"
    derived_when_unset = True
    splits_rows = True
    holds_whole_copies = True
    unused = "unset"
    report_axes = ("dp_replicate",)
    search_order = 5
    plan_column = PlanColumn("dp_repl", 7)

    def search_sizes(self, point: SearchPoint) -> list[dict[str, int]]:
        """None, or replicas whose shard group (the dense axes inside dp_replicate) fills one node."""
        dp = point.sizes["dp_shard"]
        inner = dense_axes()[dense_axes().index(self.name) + 1 :]
        group = math.prod(point.sizes.get(a, 1) for a in inner)
        replicas = [r for r in divisors(dp) if r > 1 and group // r == point.gpus_per_node]
        return [{self.name: 1}] + [{self.name: r, "dp_shard": dp // r} for r in replicas]

    def in_use(self, size: int | None) -> bool:
        return size is not None

    def exposed_comm_s(self, traffic: StepTraffic) -> float:
        """The gradient all-reduce across replicas (across every dp rank when the strategy
        replicates), half of it hidden behind backward."""
        t, s = traffic, traffic.setup
        if not (s.dp_replicate > 1 or not t.sharded):
            return 0.0
        r = s.dp_replicate if t.sharded else s.dp_shard * s.dp_replicate
        grads = (t.dense_rank / (t.fs if t.sharded else 1) + t.expert_rank / max(t.efs, 1)) * s.reduce_bytes
        return 2 * (r - 1) / r * grads / t.bandwidth(t.world) * 0.5
