"""The strategies by ``distributed.strategy`` name: one registration per strategy module."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from automodel.recipes.strategies.base import C, Strategy

#: Each strategy over its own config class (a parameter of its methods): `Strategy[Any]`.
_STRATEGIES: dict[str, Strategy[Any]] = {}


def register_strategy(strategy: Strategy[C]) -> Strategy[C]:
    """Make `strategy` selectable as ``distributed.strategy: <strategy.name>``."""
    if strategy.name in _STRATEGIES:
        raise ValueError(f"strategy {strategy.name!r} is registered twice")
    if strategy.for_world_of_one and world_of_one_strategy() is not None:
        raise ValueError(f"strategy {strategy.name!r}: a world-of-one strategy is registered already")
    _STRATEGIES[strategy.name] = strategy
    return strategy


def strategy_names() -> tuple[str, ...]:
    """Every registered strategy name, in registration order."""
    return tuple(_STRATEGIES)


def get_strategy(name: str) -> Strategy[Any]:
    """The registered strategy `name`; KeyError for an unknown one (the section parser names the key first)."""
    return _STRATEGIES[name]


def world_of_one_strategy() -> Strategy[Any] | None:
    """The registered strategy with `Strategy.for_world_of_one` (None if there is none)."""
    return next((s for s in _STRATEGIES.values() if s.for_world_of_one), None)


def planned_strategy(used: Collection[str]) -> str:
    """The strategy `recipes plan` writes for a layout using the parallelisms `used`: the first
    registered `Strategy.planned` one that lists them all (a registered subclass may list one
    more), else the first planned one (admission then refuses the size it does not list)."""
    planned = [name for name, s in _STRATEGIES.items() if s.planned]
    if not planned:
        raise ValueError("no registered strategy sets Strategy.planned")
    return next((n for n in planned if set(used) <= set(_STRATEGIES[n].supported_axes)), planned[0])
