"""Sharded data parallelism: ``distributed.dp_size`` ranks in all (dp_replicate x dp_shard), the
rows of each global batch split over them; FSDP shards parameters over dp_shard (x cp)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from automodel.recipes.parallelisms.base import Parallelism, PlanColumn, SearchPoint

if TYPE_CHECKING:
    from automodel.recipes.planning.step import StepSetup


class DataParallelShard(Parallelism[None]):
    """dp_shard = dp_size / dp_replicate_size; an unset dp_size takes what the world leaves."""

    name = "dp_shard"
    size_key = "dp_size"
    derived_when_unset = True
    splits_rows = True
    report_axes = ("dp_shard_cp", "dp_shard")
    search_order = 4
    plan_column = PlanColumn("dp_shard", 8)

    def search_sizes(self, point: SearchPoint) -> list[dict[str, int]]:
        """The ranks the model-parallel axes leave (dp_replicate splits them next)."""
        return [{self.name: point.room}]

    def plan_yaml(self, setup: StepSetup) -> list[str]:
        return []  # dp_size is derived from the world size
