"""The parallelism registry: every parallelism is one `Parallelism` module plus one registration.

A toy parallelism defined and registered in this module alone (no other file edited) is validated
(`recipes validate` accepts ``distributed.toy_size`` and runs its size and model rules), planned
(the memory estimate holds its term), reported (its layout-report line) and refused by a strategy
that does not list it (`Strategy.supported_axes`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from automodel.mesh import ResolvedLayout, axes, dense_axes, flattened_axes, moe_axes, parallel_axes
from automodel.mesh.model_parts import text_config
from automodel.recipes import load_config
from automodel.recipes._dist_setup import parse_distributed_section, resolve_layout
from automodel.recipes.cli import run_cli
from automodel.recipes.errors import ConfigError
from automodel.recipes.layout_report import summary_lines
from automodel.recipes.parallelisms import (
    ActivationSite,
    MemoryShares,
    Parallelism,
    RankReport,
    SearchPoint,
    axis_sizes,
    batch_ranks,
    get_parallelism,
    mesh_roles,
    parallelisms,
    register_parallelism,
    searched,
    sequence_length_divisor,
    shard_axis,
    unregister_parallelism,
)
from automodel.recipes.plan import plan_layout
from automodel.recipes.planning.memory import StepSetup, estimate_step_memory
from automodel.recipes.planning.models import resolve_model_config
from automodel.recipes.planning.roofline import Hardware
from automodel.recipes.planning.search import enumerate_layouts
from automodel.recipes.planning.shape import model_shape
from automodel.recipes.planning.step import sized
from automodel.recipes.planning.table import format_table, yaml_block
from automodel.recipes.planning.terms import shard_axis_of
from automodel.recipes.strategies import get_strategy, register_strategy, registry, strategy_names
from automodel.recipes.strategies.fsdp2 import FSDP2Strategy

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from automodel.recipes.config.recipe import RecipeConfig
    from automodel.recipes.planning.shape import ModelShape

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402

#: Bytes per toy rank beyond the first that the toy parallelism holds on every rank.
TOY_BYTES = 1000.0


class _ToyParallel(Parallelism):
    """A parallelism with its own size key and no mesh axis of its own."""

    name = "toy"
    size_key = "toy_size"

    def check_sizes(
        self, *, sizes: Mapping[str, int | None], data: Mapping[str, object], strategy_config: object
    ) -> None:
        toy, tp = sizes[self.size_key], sizes["tp_size"]
        if toy is not None and toy > 1 and tp is not None and tp > 1:
            raise ConfigError("distributed.toy_size", toy, "toy does not compose with tp_size > 1")

    def check_model(
        self, *, cfg: RecipeConfig, layout: ResolvedLayout, hf_config: PretrainedConfig, size: int
    ) -> None:
        layers = text_config(hf_config).num_hidden_layers
        if layers % size:
            raise ConfigError("distributed.toy_size", size, f"must divide num_hidden_layers={layers}")

    def memory_terms(self, *, size: int, setup: StepSetup, shape: ModelShape) -> dict[str, float]:
        return {"buffer": TOY_BYTES * (size - 1)} if size > 1 else {}

    def report_lines(self, report: RankReport, *, axis_sizes: Mapping[str, int]) -> list[str]:
        size = axis_sizes.get(self.name, 1)
        return [f"[rank {report['rank']}] toy ({size} ranks): one toy buffer"] if size > 1 else []


class _ToyFSDP2(FSDP2Strategy):
    """FSDP2 that also lists the toy parallelism."""

    name = "toy_fsdp2"
    supported_axes = (*FSDP2Strategy.supported_axes, "toy")


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(registry, "_STRATEGIES", dict(registry._STRATEGIES))
    register_strategy(_ToyFSDP2())
    register_parallelism(_ToyParallel())
    try:
        yield
    finally:
        unregister_parallelism("toy")


#: Bytes per token of the toy sequence split's own saved tensor, per layer.
SPLIT_BYTES = 64.0


class _ToySequenceSplit(Parallelism):
    """A parallelism that splits the sequence (like cp) and saves one tensor per layer, searched by
    `recipes plan` after the built-in axes: all through its hooks, no planning/ edit."""

    name = "toy_split"
    size_key = "toy_split_size"
    search_order = 6

    def memory_shares(self, *, size: int, setup: StepSetup, shape: ModelShape) -> MemoryShares:
        return MemoryShares(tokens=size)

    def layer_activation_terms(
        self, *, size: int, setup: StepSetup, shape: ModelShape, shares: MemoryShares, moe: bool
    ) -> dict[ActivationSite, float]:
        return {"attention": SPLIT_BYTES} if size > 1 else {}

    def search_sizes(self, point: SearchPoint) -> list[dict[str, int]]:
        return [{self.name: 1}, {self.name: 2}]

    def plan_yaml(self, setup: StepSetup) -> list[str]:
        size = setup.size_of(self.name)
        return [f"  {self.size_key}: {size}"] if size > 1 else []


@pytest.fixture
def toy_split() -> Iterator[None]:
    register_parallelism(_ToySequenceSplit())
    try:
        yield
    finally:
        unregister_parallelism("toy_split")


def _cfg(tmp_path: Path, **distributed: object) -> RecipeConfig:
    return load_config(tiny_config(str(tmp_path / "out"), distributed=distributed))


def test_the_parallelisms_are_registered_in_order() -> None:
    # the roofline adds their exposed communication in this order (bit-identical step times)
    assert [p.name for p in parallelisms()] == ["dp_shard", "dp_replicate", "tp", "cp", "ep", "pp"]
    assert [p.size_key for p in parallelisms()] == [
        "dp_size",
        "dp_replicate_size",
        "tp_size",
        "cp_size",
        "ep_size",
        "pp_size",
    ]
    with pytest.raises(ValueError, match="registered twice"):
        register_parallelism(parallelisms()[0])


def test_the_axis_table_gives_the_mesh_axes() -> None:
    assert dense_axes() == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert flattened_axes() == {
        "dp": ("dp_replicate", "dp_shard"),
        "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    }
    assert moe_axes() == ("pp", "ep_shard", "ep")
    assert parallel_axes() == ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
    assert ResolvedLayout.axis_names() == tuple(a.name for a in axes() if a.mesh != "moe") + (
        "ep_shard",
        "ep",
    )
    # every built-in parallelism sizes a mesh axis; every size key is the table's
    keys = {a.size_key for a in axes() if a.size_key is not None}
    assert {p.size_key for p in parallelisms()} == keys
    assert all(p.mesh_axis in parallel_axes() for p in parallelisms())


def test_the_mesh_roles_come_from_the_parallelisms_flags() -> None:
    """The loop reduces over roles, not axis names: rows split by data parallelism, the loss also
    over cp, the gradient norm over the pipeline's stages."""
    roles = mesh_roles()
    assert roles.batch_axes == ("dp_replicate", "dp_shard")
    assert roles.loss_axes == ("dp_replicate", "dp_shard", "cp")
    assert roles.norm_axes == ("pp",)
    assert roles.copy_axes == ("dp_replicate",)
    hsdp = parse_distributed_section({"strategy": "fsdp2", "dp_replicate_size": 2, "cp_size": 2})
    assert batch_ranks(hsdp.sizes.resolve(16)) == 8  # dp = 16 / cp


def test_a_strategys_shard_group_is_a_flattened_axis_found_by_role() -> None:
    """FSDP2 shards inside HSDP's copies, megatron-fsdp over every row-splitting rank, each with
    the cp ranks (which hold parameter replicas): the table's flattened axes, found by role."""
    assert shard_axis(over_copies=False) == "dp_shard_cp"
    assert shard_axis(over_copies=True) == "dp_cp"
    assert flattened_axes()["dp_shard_cp"] == ("dp_shard", "cp")
    memory = {
        name: get_strategy(name).memory_model(get_strategy(name).config_class()())
        for name in ("fsdp2", "megatron_fsdp", "ddp")
    }
    assert {name: shard_axis_of(m) for name, m in memory.items()} == {
        "fsdp2": "dp_shard_cp",
        "megatron_fsdp": "dp_cp",
        "ddp": None,
    }


def test_pp_options_are_keyed_step_setup_options() -> None:
    """A name a parallelism's `step_fields` / `search_options` gives that is not a `StepSetup`
    field is its own option (pp's micro-batch and schedule); setups of one run compare equal."""
    pp = get_parallelism("pp")
    section = parse_distributed_section(
        {"strategy": "fsdp2", "pp_size": 2, "pipeline": {"pp_schedule": "gpipe", "pp_microbatch_size": 2}},
        local_batch_size=4,
    )
    fields = pp.step_fields(section=section, size=2, stages=4)
    setup = StepSetup(sizes=sized(pp=2), local_batch=4).with_fields(fields)
    assert setup.stages_per_rank == 2 and setup.options == (("pp_microbatch", 2), ("pp_schedule", "gpipe"))
    assert (
        setup.option("pp_schedule", "1f1b") == "gpipe" and StepSetup().option("pp_schedule", "1f1b") == "1f1b"
    )
    assert setup == StepSetup(
        sizes=sized(pp=2),
        local_batch=4,
        options=(("pp_schedule", "gpipe"), ("pp_microbatch", 2)),
        stages_per_rank=2,
    )
    assert pp.plan_cell(setup) == "2 gpipe"
    assert pp.plan_yaml_section(setup)[1:] == ["    pp_schedule: gpipe", "    pp_microbatch_size: 2"]


@pytest.mark.parametrize(
    ("distributed", "world", "divisor"),
    [
        ({}, 2, 1),
        ({"cp_size": 2}, 2, 4),
        ({"tp_size": 2, "sequence_parallel": True}, 2, 1),
        ({"tp_size": 2, "sequence_parallel": True, "pp_size": 2, "pipeline": {}}, 4, 2),
        ({"tp_size": 2, "sequence_parallel": True, "pp_size": 2, "pipeline": {}, "cp_size": 2}, 8, 4),
        ({"tp_size": 4, "sequence_parallel": True, "pp_size": 2, "pipeline": {}, "cp_size": 2}, 16, 8),
    ],
)
def test_the_sequence_length_divisor_of_a_layout(distributed: dict, world: int, divisor: int) -> None:
    section = parse_distributed_section({"strategy": "fsdp2", **distributed})
    layout = section.sizes.resolve(world)
    assert sequence_length_divisor(section, layout) == divisor


def test_strategies_refuse_what_they_do_not_list() -> None:
    """The allow-list: each built-in strategy's refusal names the key and the strategy."""
    with pytest.raises(ConfigError, match=r"distributed.tp_size=2: ddp is data parallelism only"):
        parse_distributed_section({"strategy": "ddp", "tp_size": 2})
    with pytest.raises(ConfigError, match=r"distributed.dp_replicate_size=1: is FSDP2-only \(strategy=ddp\)"):
        parse_distributed_section({"strategy": "ddp", "dp_replicate_size": 1})
    with pytest.raises(ConfigError, match=r"distributed.ep_size=2: megatron_fsdp does not support it"):
        parse_distributed_section({"strategy": "megatron_fsdp", "ep_size": 2})
    with pytest.raises(
        ConfigError, match=r"distributed.dp_replicate_size=2: is FSDP2-only \(strategy=megatron_fsdp\)"
    ):
        parse_distributed_section({"strategy": "megatron_fsdp", "dp_replicate_size": 2})
    with pytest.raises(
        ConfigError,
        match=r"distributed.cp_size=2: strategy megatron_fsdp splits no attention over cp here \(each cp rank "
        r"would attend over the whole sequence\); use strategy fsdp2 for cp_size > 1",
    ):
        parse_distributed_section({"strategy": "megatron_fsdp", "cp_size": 2})
    assert set(get_strategy("fsdp2").supported_axes) == {p.name for p in parallelisms()}


def test_a_toy_parallelism_is_validated_by_its_own_rules(toy: None, tmp_path: Path) -> None:
    section = parse_distributed_section({"strategy": "toy_fsdp2", "toy_size": 2})
    assert section.other_sizes == {"toy_size": 2}
    assert parse_distributed_section({"strategy": "toy_fsdp2"}).other_sizes == {"toy_size": 1}
    # its size rule
    with pytest.raises(ConfigError, match="distributed.toy_size=2: toy does not compose with tp_size > 1"):
        parse_distributed_section({"strategy": "toy_fsdp2", "toy_size": 2, "tp_size": 2})
    with pytest.raises(ConfigError, match=r"distributed.toy_size='two': must be an int >= 1"):
        parse_distributed_section({"strategy": "toy_fsdp2", "toy_size": "two"})
    # its model rule, through `recipes validate`'s pre-launch check (the tiny model has 2 layers)
    with pytest.raises(ConfigError, match="distributed.toy_size=3: must divide num_hidden_layers=2"):
        plan_layout(_cfg(tmp_path, strategy="toy_fsdp2", toy_size=3), world_size=2)
    _, _, lines = plan_layout(_cfg(tmp_path, strategy="toy_fsdp2", toy_size=2), world_size=2)
    assert any(line.split() == ["toy", "2"] for line in lines), lines


def test_recipes_validate_accepts_the_toy_size_and_refuses_a_bad_one(
    toy: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def validate(toy_size: int) -> int:
        path = tmp_path / f"toy{toy_size}.yaml"
        raw = tiny_config(str(tmp_path / "out"), distributed={"strategy": "toy_fsdp2", "toy_size": toy_size})
        path.write_text(yaml.safe_dump(raw))
        return run_cli(["validate", str(path), "--world-size", "2"])

    assert validate(2) == 0
    assert "config OK for world_size=2 (strategy=toy_fsdp2)" in capsys.readouterr().out
    assert validate(3) == 2
    assert "error: distributed.toy_size=3: must divide num_hidden_layers=2" in capsys.readouterr().err


def test_a_toy_parallelism_is_planned_with_its_memory_term(toy: None, tmp_path: Path) -> None:
    _, off, _ = plan_layout(_cfg(tmp_path, strategy="toy_fsdp2"), world_size=2)
    _, on, _ = plan_layout(_cfg(tmp_path, strategy="toy_fsdp2", toy_size=2), world_size=2)
    assert on.peak_parts["toy buffer"] == TOY_BYTES and "toy buffer" not in off.peak_parts
    assert on.peak_bytes == off.peak_bytes + TOY_BYTES


def test_a_toy_parallelism_is_reported(toy: None) -> None:
    section = parse_distributed_section({"strategy": "toy_fsdp2", "toy_size": 2})
    layout = resolve_layout(section, 2)
    report = {
        "rank": 0,
        "strategy": "toy_fsdp2",
        "parts": [{"parameters": {}, "layers": [], "fsdp_units": [], "checkpointed": []}],
    }
    lines = summary_lines(report, axis_sizes=axis_sizes(section, layout))
    assert "[rank 0] toy (2 ranks): one toy buffer" in lines


def test_a_toy_parallelism_is_refused_by_a_strategy_that_does_not_list_it(toy: None) -> None:
    assert "toy_fsdp2" in strategy_names()
    parse_distributed_section({"strategy": "fsdp2", "toy_size": 1})  # off: nothing to refuse
    with pytest.raises(
        ConfigError,
        match=r"distributed.toy_size=2: is not supported by strategy fsdp2 \(must be 1; it supports "
        r"dp_shard, dp_replicate, tp, pp, cp, ep\)",
    ):
        parse_distributed_section({"strategy": "fsdp2", "toy_size": 2})
    with pytest.raises(ConfigError, match=r"distributed.toy_size=2: ddp is data parallelism only"):
        parse_distributed_section({"strategy": "ddp", "toy_size": 2})


def test_unregistered_the_toy_size_is_an_unknown_key() -> None:
    with pytest.raises(ConfigError, match="distributed.toy_size"):
        parse_distributed_section({"toy_size": 2})


def test_plan_searches_the_built_in_axes_in_their_order() -> None:
    # the table's columns and the YAML's keys come in this order too
    assert [p.name for p in searched()] == ["tp", "pp", "cp", "ep", "dp_shard", "dp_replicate"]


def test_a_new_parallelism_scales_the_memory_estimate_through_its_hooks(toy_split: None) -> None:
    shape = model_shape(resolve_model_config("llama3.1-8b"))
    base = StepSetup(sizes=sized(dp_shard=4), seq_len=4096, compute_bytes=2)
    off = estimate_step_memory(shape, base)
    on = estimate_step_memory(
        shape, StepSetup(sizes=sized(dp_shard=4, toy_split=2), seq_len=4096, compute_bytes=2)
    )
    half = estimate_step_memory(shape, StepSetup(sizes=sized(dp_shard=4), seq_len=2048, compute_bytes=2))
    assert base.size_of("toy_split") == 1 and on.params_per_rank == off.params_per_rank
    # half the tokens on each rank, plus its own tensor per layer and token
    assert on.activation_bytes == half.activation_bytes + shape.layers * SPLIT_BYTES * 2048
    assert on.activation_bytes < off.activation_bytes


def test_a_new_parallelism_is_searched_and_proposed(toy_split: None) -> None:
    shape = model_shape(resolve_model_config("llama3.1-8b"))
    cands = enumerate_layouts(shape, gpus=8, seq_len=4096, hardware=Hardware(memory_bytes=1e15))
    split = [c for c in cands if c.setup.size_of("toy_split") == 2]
    assert split and len(split) == len(cands) // 2
    head = format_table(split[:1])[0].split()
    assert head[:8] == ["#", "tp", "pp", "(schedule)", "cp", "ep", "dp_shard", "dp_repl"]
    assert head[8] == "toy_split"
    assert "  toy_split_size: 2" in yaml_block(split[0], global_batch=8)


def test_a_model_refusal_is_worded_by_one_helper(toy: None) -> None:
    """`check_meta_model`'s refusals all come from `Parallelism.cannot_apply` (one wording, naming the
    size key): no parallelism module spells the message itself."""
    error = get_parallelism("toy").cannot_apply(2, "its layers are not a list")
    assert str(error) == "distributed.toy_size=2: cannot be applied: its layers are not a list"
    package = Path(Parallelism.__module__.replace(".", "/")).parent
    modules = sorted((Path(__file__).parents[1] / "src" / package).glob("*.py"))
    assert len(modules) >= 8
    spelled = [m.name for m in modules if m.name != "base.py" and "cannot be applied" in m.read_text()]
    assert spelled == []


def test_packed_rows_take_one_row_per_forward_from_the_pipelines_micro_batch(tmp_path: Path) -> None:
    """The packed-rows rule asks the parallelisms how many rows one forward takes
    (`Parallelism.forward_rows`): under pp, the pipeline's micro-batch (without pp the YAML
    translation already runs packed rows one per micro-batch)."""
    packed = {
        "packed_sequence": {"packed_sequence_size": 32},
        "step_scheduler": {"local_batch_size": 2, "global_batch_size": 2},
    }
    by_rows = {"pp_size": 2, "pipeline": {"pp_microbatch_size": 1, "pp_schedule": "1f1b"}}
    cfg = load_config(tiny_config(str(tmp_path / "out"), distributed=by_rows, **packed))
    assert cfg.step_scheduler.local_batch_size == 2
    assert [r for p in parallelisms() if (r := p.forward_rows(cfg.distributed)) is not None] == [1]
    two = {"pp_size": 2, "pipeline": {"pp_microbatch_size": 2, "pp_schedule": "1f1b"}}
    with pytest.raises(
        ConfigError, match="step_scheduler.local_batch_size=2: must be 1 for packed sequences"
    ):
        load_config(tiny_config(str(tmp_path / "out"), distributed=two, **packed))
