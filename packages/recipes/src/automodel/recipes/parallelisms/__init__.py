"""The parallelisms of the recipes, by name: data parallel shard and replicate, tp, pp, cp, ep.

Each module holds one `Parallelism` subclass; it is registered here, once, in the order the
section parser reads their sizes and `rules.check_layout_rules` runs their rules. A new parallelism
is one module plus one `register_parallelism` call (a test may register one itself).
"""

from automodel.recipes.parallelisms.base import BatchRun, MicroBatch, Parallelism, RankReport, config_error
from automodel.recipes.parallelisms.cp import ContextParallel
from automodel.recipes.parallelisms.dp_replicate import DataParallelReplicate
from automodel.recipes.parallelisms.dp_shard import DataParallelShard
from automodel.recipes.parallelisms.ep import ExpertParallel
from automodel.recipes.parallelisms.pp import PipelineParallel
from automodel.recipes.parallelisms.registry import (
    axis_sizes,
    get_parallelism,
    memory_terms,
    parallelisms,
    register_parallelism,
    section_keys,
    size_keys,
    unregister_parallelism,
)
from automodel.recipes.parallelisms.tp import TensorParallel

register_parallelism(DataParallelShard())
register_parallelism(DataParallelReplicate())
register_parallelism(TensorParallel())
register_parallelism(PipelineParallel())
register_parallelism(ContextParallel())
register_parallelism(ExpertParallel())

#: The built-in parallelisms' names (what a strategy supporting all of them lists).
BUILT_IN: tuple[str, ...] = tuple(p.name for p in parallelisms())

__all__ = [
    "BUILT_IN",
    "BatchRun",
    "MicroBatch",
    "Parallelism",
    "RankReport",
    "axis_sizes",
    "config_error",
    "get_parallelism",
    "memory_terms",
    "parallelisms",
    "register_parallelism",
    "section_keys",
    "size_keys",
    "unregister_parallelism",
]
