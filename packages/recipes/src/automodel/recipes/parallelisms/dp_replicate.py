"""Replicated data parallelism (HSDP's outer dim): ``distributed.dp_replicate_size`` copies of the
dp_shard-sharded model, gradients all-reduced across them."""

from __future__ import annotations

from automodel.recipes.parallelisms.base import Parallelism


class DataParallelReplicate(Parallelism):
    """Any value set asks for it (even 1): strategies without HSDP refuse the key itself."""

    name = "dp_replicate"
    size_key = "dp_replicate_size"
    derived_when_unset = True
    unused = "unset"
    report_axes = ("dp_replicate",)

    def in_use(self, size: int | None) -> bool:
        return size is not None
