"""The strategy registry: every strategy is one `Strategy` module plus one registration."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from automodel.mesh import StrategyConfig
from automodel.recipes._dist_setup import parse_distributed_section
from automodel.recipes.errors import ConfigError
from automodel.recipes.planning.memory import StrategyMemory
from automodel.recipes.strategies import Strategy, get_strategy, register_strategy, registry, strategy_names

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402


def test_the_strategies_are_registered_in_order() -> None:
    assert strategy_names() == ("fsdp2", "megatron_fsdp", "ddp", "single")
    assert all(get_strategy(n).name == n for n in strategy_names())
    with pytest.raises(ValueError, match="registered twice"):
        register_strategy(get_strategy("ddp"))


@dataclass(frozen=True)
class _ToyConfig(StrategyConfig):
    backend: str = "gloo"
    toy_flag: int = 0


class _ToyStrategy(Strategy[_ToyConfig]):
    name = "toy"

    def config_class(self) -> type[_ToyConfig]:
        return _ToyConfig

    def check_sizes(self, sizes: dict[str, int | None], options: dict[str, Any], config: _ToyConfig) -> None:
        if sizes["tp_size"] != 1:
            raise ConfigError("distributed.tp_size", sizes["tp_size"], "toy is data parallel only")

    def memory_model(self, config: _ToyConfig) -> StrategyMemory:
        return StrategyMemory(shard_over="none", gathered_weights="none", reduce_scatter_in_flight=False)

    def parallelize(self, model, **_: Any):  # type: ignore[override]
        raise NotImplementedError


def test_a_registered_strategy_is_selectable_with_its_own_flags_and_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry, "_STRATEGIES", dict(registry._STRATEGIES))
    register_strategy(_ToyStrategy())
    section = parse_distributed_section({"strategy": "toy", "toy_flag": 3})
    assert isinstance(section.strategy_config, _ToyConfig) and section.strategy_config.toy_flag == 3
    with pytest.raises(ConfigError, match="distributed.tp_size"):
        parse_distributed_section({"strategy": "toy", "tp_size": 2})
    with pytest.raises(ConfigError, match="distributed.toy_flag.*is not an option of strategy 'fsdp2'"):
        parse_distributed_section({"toy_flag": 1})
    # the axes it supports are an allow-list: `Strategy.supported_axes` defaults to data parallel only
    assert _ToyStrategy.supported_axes == ("dp_shard",)
    with pytest.raises(
        ConfigError, match=r"distributed.cp_size=2: is not supported by strategy toy \(must be 1"
    ):
        parse_distributed_section({"strategy": "toy", "cp_size": 2})


def test_the_memory_planner_reads_a_registered_strategy_through_its_memory_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`recipes validate`'s estimate of a new strategy comes from its `memory_model` alone: a
    replicated toy holds every parameter on each rank, as DDP does (no name is matched anywhere)."""
    from automodel.recipes import load_config
    from automodel.recipes.plan import plan_layout

    monkeypatch.setattr(registry, "_STRATEGIES", dict(registry._STRATEGIES))
    register_strategy(_ToyStrategy())
    mems = {
        name: plan_layout(
            load_config(tiny_config(str(tmp_path), distributed={"strategy": name})), world_size=2
        )[1]
        for name in ("toy", "ddp", "fsdp2")
    }
    assert mems["toy"].param_bytes == mems["ddp"].param_bytes == 2 * mems["fsdp2"].param_bytes


def test_unknown_strategy_lists_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match="must be one of fsdp2, megatron_fsdp, ddp, single"):
        parse_distributed_section({"strategy": "zero"})


def _ddp_alone_with_activation_checkpointing() -> tuple[bool, list[str]]:
    """One rank, ddp with activation_checkpointing: no DDP wrapper, but the layers are checkpointed."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.nn.parallel import DistributedDataParallel

    from automodel.mesh import MeshContext
    from automodel.testing.tiny_model import tiny_causal_lm

    section = parse_distributed_section({"strategy": "ddp", "activation_checkpointing": True})
    model = tiny_causal_lm("llama", layers=2)
    pm = get_strategy("ddp").parallelize(
        model,
        mesh=MeshContext.build(section.sizes, device_type="cpu"),
        section=section,
        device=torch.device("cpu"),
        initialize=lambda parts: None,
        gradient_divide_factor=None,
        pipeline_loss_fn=None,
    )
    part = pm.parts[0]
    wrapped = isinstance(part, DistributedDataParallel)
    return wrapped, [n for n, m in part.named_modules() if isinstance(m, CheckpointWrapper)]


def test_ddp_at_dp_1_still_applies_activation_checkpointing() -> None:
    """The flag is honoured without the wrapper (the memory planner counts it either way)."""
    from automodel.testing.ranks import run_on_ranks

    wrapped, checkpointed = run_on_ranks(_ddp_alone_with_activation_checkpointing, world_size=1)[0]
    assert not wrapped
    assert checkpointed == ["model.layers.0", "model.layers.1"]
