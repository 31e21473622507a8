"""The parallelisms of the recipes, by name: data parallel shard and replicate, tp, cp, ep, pp.

Each module holds one `Parallelism` subclass; it is registered here, once. The registration order
is the order the section parser reads their sizes, `rules.check_layout_rules` runs their rules,
the layout report prints their lines and the roofline adds their exposed communication (the order
its sums had before the registry: the step times are unchanged to the bit). A new parallelism is
one module plus one `register_parallelism` call (a test may register one itself).
"""

from automodel.recipes.parallelisms.base import (
    ActivationSite,
    BatchRun,
    MemoryShares,
    MicroBatch,
    ModelSplit,
    Parallelism,
    PlanColumn,
    RankPosition,
    RankReport,
    SearchPoint,
    StageBuild,
    config_error,
    divisors,
)
from automodel.recipes.parallelisms.cp import ContextParallel
from automodel.recipes.parallelisms.dp_replicate import DataParallelReplicate
from automodel.recipes.parallelisms.dp_shard import DataParallelShard
from automodel.recipes.parallelisms.ep import ExpertParallel
from automodel.recipes.parallelisms.pp import PipelineParallel
from automodel.recipes.parallelisms.registry import (
    axis_sizes,
    get_parallelism,
    in_apply_order,
    in_plan_order,
    parallelisms,
    register_parallelism,
    searched,
    section_keys,
    size_keys,
    unregister_parallelism,
)
from automodel.recipes.parallelisms.roles import (
    MeshRoles,
    batch_rank,
    batch_ranks,
    mesh_roles,
    role_group,
    sequence_length_divisor,
    shard_axis,
)
from automodel.recipes.parallelisms.tp import TensorParallel

register_parallelism(DataParallelShard())
register_parallelism(DataParallelReplicate())
register_parallelism(TensorParallel())
register_parallelism(ContextParallel())
register_parallelism(ExpertParallel())
register_parallelism(PipelineParallel())

#: The built-in parallelisms' names (what a strategy supporting all of them lists).
BUILT_IN: tuple[str, ...] = tuple(p.name for p in parallelisms())

__all__ = [
    "BUILT_IN",
    "ActivationSite",
    "BatchRun",
    "MemoryShares",
    "MeshRoles",
    "MicroBatch",
    "ModelSplit",
    "Parallelism",
    "PlanColumn",
    "RankPosition",
    "RankReport",
    "SearchPoint",
    "StageBuild",
    "axis_sizes",
    "batch_rank",
    "batch_ranks",
    "config_error",
    "divisors",
    "get_parallelism",
    "in_apply_order",
    "in_plan_order",
    "mesh_roles",
    "parallelisms",
    "register_parallelism",
    "role_group",
    "searched",
    "sequence_length_divisor",
    "section_keys",
    "shard_axis",
    "size_keys",
    "unregister_parallelism",
]
