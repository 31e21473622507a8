"""Data-parallel strategies of the recipes, by ``distributed.strategy`` name.

Each module holds one `Strategy` subclass; it is registered here, once. A new strategy is one
module plus one `register_strategy` line below.
"""

from automodel.recipes.strategies.base import Initialize, ParallelModel, Strategy
from automodel.recipes.strategies.ddp import DDPStrategy
from automodel.recipes.strategies.fsdp2 import FSDP2Strategy
from automodel.recipes.strategies.megatron_fsdp import MegatronFSDPStrategy
from automodel.recipes.strategies.registry import (
    get_strategy,
    register_strategy,
    strategy_names,
    world_of_one_strategy,
)
from automodel.recipes.strategies.single import SingleStrategy

register_strategy(FSDP2Strategy())
register_strategy(MegatronFSDPStrategy())
register_strategy(DDPStrategy())
register_strategy(SingleStrategy())

__all__ = [
    "Initialize",
    "ParallelModel",
    "Strategy",
    "get_strategy",
    "register_strategy",
    "strategy_names",
    "world_of_one_strategy",
]
