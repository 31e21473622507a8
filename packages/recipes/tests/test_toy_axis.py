"""A seventh parallelism with its own mesh axis, from this file alone: one `register_axis` (its mesh
dim) and one `register_parallelism` (its rules and planner terms). `recipes validate` sizes it,
names it in the layout's axis table and resolves the mesh on a fake world; the memory estimate
takes its share of the tokens through its hook; `recipes plan`'s search sizes it, with its column
and YAML line; a strategy that does not list it refuses it.

Not covered here: `recipes train` under it (the toy applies nothing to the model).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from automodel.mesh import Axis, ParallelismSizes, register_axis, unregister_axis
from automodel.recipes import load_config
from automodel.recipes._dist_setup import parse_distributed_section
from automodel.recipes.cli import run_cli
from automodel.recipes.errors import ConfigError
from automodel.recipes.parallelisms import (
    MemoryShares,
    Parallelism,
    SearchPoint,
    register_parallelism,
    unregister_parallelism,
)
from automodel.recipes.plan import plan_layout
from automodel.recipes.planning.models import resolve_model_config
from automodel.recipes.planning.roofline import Hardware
from automodel.recipes.planning.search import enumerate_layouts
from automodel.recipes.planning.shape import model_shape
from automodel.recipes.planning.table import format_table, yaml_block
from automodel.recipes.strategies import register_strategy, registry
from automodel.recipes.strategies.fsdp2 import FSDP2Strategy

if TYPE_CHECKING:
    from automodel.recipes.config.recipe import RecipeConfig
    from automodel.recipes.planning.shape import ModelShape
    from automodel.recipes.planning.step import StepSetup

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402


class _ToySequenceAxis(Parallelism[None]):
    """An Ulysses-style sequence axis: its own dense mesh dim ``sq`` just outside tp; each rank
    holds 1/sq of every sequence's tokens."""

    name = "sq"
    size_key = "sq_size"

    search_order = 3  # after ep (registered earlier), before dp_shard takes the rest

    def memory_shares(self, *, size: int, setup: StepSetup, shape: ModelShape) -> MemoryShares:
        return MemoryShares(tokens=size)

    def search_sizes(self, point: SearchPoint) -> list[dict[str, int]]:
        return [{self.name: d} for d in (1, 2) if point.room % d == 0]


class _SqFSDP2(FSDP2Strategy):
    """FSDP2 that also lists the toy axis."""

    name = "sq_fsdp2"
    supported_axes = (*FSDP2Strategy.supported_axes, "sq")


@pytest.fixture
def sq(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(registry, "_STRATEGIES", dict(registry._STRATEGIES))
    register_strategy(_SqFSDP2())
    register_axis(Axis("sq", "dense", size_key="sq_size", model_parallel=True), before="tp")
    register_parallelism(_ToySequenceAxis())
    try:
        yield
    finally:
        unregister_parallelism("sq")
        unregister_axis("sq")


def _cfg(tmp_path: Path, **distributed: object) -> RecipeConfig:
    return load_config(tiny_config(str(tmp_path / "out"), distributed=distributed))


def test_the_toy_axis_is_a_mesh_size_of_the_section(sq: None) -> None:
    section = parse_distributed_section({"strategy": "sq_fsdp2", "sq_size": 2})
    assert section.sizes == ParallelismSizes(sq_size=2)
    assert section.other_sizes == {}  # a mesh axis: not one of the sizes outside the mesh
    with pytest.raises(ConfigError, match=r"distributed.sq_size=0: must be an int >= 1"):
        parse_distributed_section({"strategy": "sq_fsdp2", "sq_size": 0})
    with pytest.raises(ConfigError, match=r"distributed.sq_size=2: is not supported by strategy fsdp2"):
        parse_distributed_section({"strategy": "fsdp2", "sq_size": 2})


def test_recipes_validate_sizes_and_reports_the_toy_axis(
    sq: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sq.yaml"
    path.write_text(
        yaml.safe_dump(tiny_config(str(tmp_path / "out"), distributed={"strategy": "sq_fsdp2", "sq_size": 2}))
    )
    assert run_cli(["validate", str(path), "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    assert ["sq", "2"] in rows and ["dp_shard", "2"] in rows, out
    assert run_cli(["validate", str(path), "--world-size", "3"]) == 2
    assert "world_size 3 is not divisible by pp_size*cp_size*sq_size*tp_size = 2" in capsys.readouterr().err


def test_the_estimate_takes_the_toy_axis_share_of_the_tokens(sq: None, tmp_path: Path) -> None:
    layout, on, _ = plan_layout(_cfg(tmp_path, strategy="sq_fsdp2", sq_size=2), world_size=4)
    _, off, _ = plan_layout(_cfg(tmp_path, strategy="sq_fsdp2"), world_size=2)
    assert (layout.sq, layout.dp_shard, layout.axis_size("sq")) == (2, 2, 2)
    # the same dp_shard (2) either way: the toy halves each rank's tokens, not its parameters
    assert on.params_per_rank == off.params_per_rank
    assert 0 < on.activation_bytes < off.activation_bytes


def test_recipes_plan_searches_the_toy_axis(sq: None) -> None:
    shape = model_shape(resolve_model_config("llama3.1-8b"))
    cands = enumerate_layouts(shape, gpus=8, seq_len=4096, hardware=Hardware(memory_bytes=1e15))
    split = [c for c in cands if c.setup.sq == 2]
    assert split and len(split) < len(cands)
    # every candidate fills the 8 GPUs with its dense axes, the toy's included
    assert all(
        c.setup.sq * c.setup.tp * c.setup.pp * c.setup.cp * c.setup.dp_shard * c.setup.dp_replicate == 8
        for c in cands
    )
    head = format_table(split[:1])[0].split()
    assert head[:6] == ["#", "tp", "pp", "(schedule)", "cp", "ep"] and head[6] == "sq"
    assert "  sq_size: 2" in yaml_block(split[0], global_batch=8)
