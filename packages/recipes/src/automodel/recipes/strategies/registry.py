"""The strategies by ``distributed.strategy`` name: one registration per strategy module."""

from __future__ import annotations

from automodel.recipes.strategies.base import Strategy

_STRATEGIES: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy) -> Strategy:
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


def get_strategy(name: str) -> Strategy:
    """The registered strategy `name`; KeyError for an unknown one (the section parser names the key first)."""
    return _STRATEGIES[name]


def world_of_one_strategy() -> Strategy | None:
    """The registered strategy with `Strategy.for_world_of_one` (None if there is none)."""
    return next((s for s in _STRATEGIES.values() if s.for_world_of_one), None)
