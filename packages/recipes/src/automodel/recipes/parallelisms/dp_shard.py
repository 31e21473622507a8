"""Sharded data parallelism: ``distributed.dp_size`` ranks in all (dp_replicate x dp_shard), the
rows of each global batch split over them; FSDP shards parameters over dp_shard (x cp)."""

from __future__ import annotations

from automodel.recipes.parallelisms.base import Parallelism


class DataParallelShard(Parallelism):
    """dp_shard = dp_size / dp_replicate_size; an unset dp_size takes what the world leaves."""

    name = "dp_shard"
    size_key = "dp_size"
    derived_when_unset = True
    report_axes = ("dp_shard_cp", "dp_shard")
