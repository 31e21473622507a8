"""A seventh parallelism with its own mesh axis, from this file alone: one `register_axis` (its mesh
dim, whose ranks hold parameter replicas) and one `register_parallelism` (its rules, planner terms,
batch split and attention), plus the FSDP2 strategy subclass that lists it.

The toy is a real Ulysses-style sequence parallelism: each rank of the ``sq`` axis holds 1/sq of
every row's tokens; around the attention core, one all-to-all over the sq group turns [tokens/sq,
all heads] into [all tokens, heads/sq] and another turns the output back (transformers' attention
registry, the seam context parallelism uses too). `recipes validate` sizes it, names it in the
layout's axis table and resolves the mesh on a fake world; the memory estimate takes its share of
the tokens through its hook; `recipes plan`'s search sizes it, with its column and YAML line, and
admits the layouts it proposes; a strategy that does not list it refuses it; `recipes train` (the
CLI's rank path, 4 gloo ranks) trains equal to one process, and the layout report shows the axis,
the sharding over it and the attention it swapped.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import yaml
from safetensors.torch import load_file
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from automodel.mesh import (
    Axis,
    ParallelismSizes,
    ResolvedLayout,
    StrategyConfig,
    register_axis,
    unregister_axis,
)
from automodel.recipes import load_config
from automodel.recipes._dist_setup import parse_distributed_section
from automodel.recipes.cli import run_cli
from automodel.recipes.errors import ConfigError
from automodel.recipes.layout_report import summary_lines
from automodel.recipes.parallelisms import (
    BatchRun,
    MemoryShares,
    MicroBatch,
    Parallelism,
    RankReport,
    SearchPoint,
    StageBuild,
    register_parallelism,
    unregister_parallelism,
)
from automodel.recipes.parallelisms.base import sharded_on
from automodel.recipes.plan import plan_layout
from automodel.recipes.planning.models import resolve_model_config
from automodel.recipes.planning.propose import plan
from automodel.recipes.planning.roofline import Hardware
from automodel.recipes.planning.search import enumerate_layouts
from automodel.recipes.planning.shape import model_shape
from automodel.recipes.planning.table import format_table, yaml_block
from automodel.recipes.strategies import register_strategy, registry
from automodel.recipes.strategies.fsdp2 import FSDP2Strategy
from automodel.testing.ranks import run_on_ranks

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from automodel.recipes.config.distributed import DistributedSection
    from automodel.recipes.config.recipe import RecipeConfig
    from automodel.recipes.planning.shape import ModelShape
    from automodel.recipes.planning.step import StepSetup

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import RTOL, TINY, assert_losses_close, preload, tiny_config  # noqa: E402

preload()


#: The toy's name in transformers' attention registry (`AttentionInterface`).
_ATTENTION = "toy_sq_ulysses"
#: The attribute an attention module carries the sq group on (set by `apply_to_stage`).
_GROUP = "_toy_sq_group"
#: What the toy's attention saw on this process (a forked rank's own copy): the local sequence
#: length of each call, and how many all-to-alls it ran.
_SEEN: list[int] = []
_SWAPS: list[int] = [0]


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Block j of dim 0 goes to rank j of `group`; block i of the result came from rank i
    (torch.distributed.nn's all-to-all: its backward is the reverse all-to-all)."""
    _SWAPS[0] += 1
    x = x.contiguous()  # the collective reads and writes dense memory (`empty_like` keeps strides)
    return dist_nn.all_to_all_single(torch.empty_like(x), x, group=group)


def _tokens_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, H, S/n, D] (this rank's tokens, every head) -> [B, H/n, S, D] (every token, its heads)."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    blocks = _all_to_all(x.reshape(b, n, h // n, s, d).transpose(0, 1), group)  # [n, B, H/n, S/n, D]
    return blocks.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, S, H/n, D] (every token, this rank's heads) -> [B, S/n, H, D] (its tokens, every head)."""
    n = dist.get_world_size(group)
    b, s, h, d = x.shape
    blocks = _all_to_all(x.reshape(b, n, s // n, h, d).transpose(0, 1), group)  # [n, B, S/n, H/n, D]
    return blocks.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def _ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' SDPA attention over the whole row, for this sq rank's heads."""
    group = getattr(module, _GROUP)
    if attention_mask is not None:  # transformers builds none for an implementation it has no mask for
        raise RuntimeError("the toy sq attention got an attention mask (of the local shape)")
    _SEEN.append(query.shape[2])
    q, k, v = (_tokens_to_heads(t, group) for t in (query, key, value))
    kwargs.pop("is_causal", None)
    out, weights = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)
    return _heads_to_tokens(out, group), weights


def _attention_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in module.named_modules() if name.endswith("self_attn")]


class _ToySequenceAxis(Parallelism[None]):
    """An Ulysses-style sequence axis: its own dense mesh dim ``sq`` just outside tp; each rank
    holds 1/sq of every row's tokens and, inside attention, all of them for 1/sq of the heads."""

    name = "sq"
    size_key = "sq_size"
    splits_tokens = True  # each rank's loss is over its tokens: the loss sums over sq
    apply_phase = 25  # after CP's hooks, before EP

    search_order = 3  # after ep (registered earlier), before dp_shard takes the rest

    def check_sizes(
        self, *, sizes: Mapping[str, int | None], data: Mapping[str, object], strategy_config: StrategyConfig
    ) -> None:
        if (sizes.get(self.size_key) or 1) == 1:
            return
        for key in ("tp_size", "cp_size", "pp_size", "ep_size"):
            if (sizes.get(key) or 1) > 1:
                raise ConfigError(
                    f"distributed.{key}", sizes[key], "the toy sq axis composes with data parallelism only"
                )

    def sequence_divisor(self, *, section: DistributedSection, layout: ResolvedLayout, size: int) -> int:
        return size  # equal shares of each row

    def check_model(
        self, *, cfg: RecipeConfig, layout: ResolvedLayout, hf_config: PretrainedConfig, size: int
    ) -> None:
        if size == 1:
            return
        if cfg.seq_length % size:
            raise ConfigError(cfg.seq_length_key, cfg.seq_length, f"must be divisible by sq_size = {size}")
        if cfg.packed_sequence.packed_sequence_size > 0:
            raise ConfigError(
                "packed_sequence.packed_sequence_size",
                cfg.packed_sequence.packed_sequence_size,
                "the toy sq axis attends causally over whole rows (no document boundaries)",
            )
        for key in ("num_attention_heads", "num_key_value_heads"):
            count = getattr(hf_config, key)
            if count % size:
                raise ConfigError("distributed.sq_size", size, f"must divide model {key}={count}")

    def apply_to_stage(self, module: nn.Module, *, build: StageBuild, size: int) -> None:
        """Every attention module runs `_ulysses_attention` over this rank's sq group."""
        if size == 1:
            return
        group = build.mesh.get_mesh("sq").get_group()
        for _, attention in _attention_modules(module):
            setattr(attention, _GROUP, group)
        AttentionInterface.register(_ATTENTION, _ulysses_attention)
        config = getattr(module, "config")  # noqa: B009 - an HF model's
        config._attn_implementation = _ATTENTION

    def shard_batch(self, batch: MicroBatch, *, run: BatchRun) -> MicroBatch:
        """This rank's contiguous 1/sq of every row (the sequence is dim 1 of every field)."""
        if run.mesh.layout.axis_size("sq") == 1:
            return batch
        mesh = run.mesh.get_mesh("sq")
        n, index = mesh.size(), mesh.get_local_rank()
        fields = {k: v.tensor_split(n, dim=1)[index] for k, v in batch.fields.items()}
        return MicroBatch(fields=fields, extra=batch.extra, context=batch.context)

    def describe_part(self, part: nn.Module) -> dict[str, object]:
        """The attention modules that carry the sq group (read off the live part)."""
        return {"sq_attention": [name for name, m in _attention_modules(part) if hasattr(m, _GROUP)]}

    def report_lines(self, report: RankReport, *, axis_sizes: Mapping[str, int]) -> list[str]:
        size = axis_sizes.get(self.name, 1)
        parts = report["parts"]
        assert isinstance(parts, list)
        modules = sum(len(part.get("sq_attention", [])) for part in parts)
        if size == 1 or not modules:
            return []
        return [f"[rank {report['rank']}] sq ({size} ranks): all-to-all attention in {modules} modules"]

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
    # its ranks hold the same parameters: FSDP shards over it too, and gradients sum over it
    register_axis(
        Axis("sq", "dense", size_key="sq_size", model_parallel=True, holds_replicas=True), before="tp"
    )
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
    # the same dp_shard (2) either way: the toy halves each rank's tokens, and FSDP shards over its
    # ranks too (they hold replicas: `Axis.holds_replicas`), as `recipes train` does
    assert on.params_per_rank == off.params_per_rank / 2
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


def test_recipes_plan_admits_the_toy_axis_layouts(sq: None) -> None:
    """The layouts `recipes plan` proposes pass `recipes train`'s pre-launch resolution
    (`planning.admit`): a toy layout's YAML names the strategy that lists the axis, and the toy's
    own rules refuse what it does not compose with, with their message."""
    best, lines = plan(model="llama3.1-8b", gpus=8, seq_len=4096, top=10)
    toy = [c for c in best if c.setup.sq == 2]
    assert toy, lines
    assert "  strategy: sq_fsdp2" in yaml_block(toy[0], global_batch=8)
    assert all(c.setup.tp == c.setup.cp == c.setup.pp == 1 for c in toy)
    assert any("the toy sq axis composes with data parallelism only" in line for line in lines), lines
    assert "  strategy: fsdp2" in yaml_block(next(c for c in best if c.setup.sq == 1), global_batch=8)


# ---- recipes train under the toy ---------------------------------------------------------------
#: 8 query heads over 4 KV heads (head_dim 8): sq=4 leaves each rank 2 query heads over 1 KV head.
_MODEL = {"config": {**TINY["model"]["config"], "num_attention_heads": 8, "num_key_value_heads": 4}}
_TIMEOUT = 300


def _cli_train_on_rank(path: str) -> dict[str, object]:
    """Rank function: the `recipes train` command as a rank of a torchrun job runs it (this forked
    process carries the toy's registrations), then what the toy's attention saw here."""
    code = run_cli(["train", path])
    return {"code": code, "seen": list(_SEEN), "swaps": _SWAPS[0]}


def _train(out: Path, *, world_size: int, **distributed: object) -> dict[str, Any]:
    """Train the tiny model for 3 steps on `world_size` ranks; its metrics, final parameters (the
    consolidated checkpoint) and per-rank layout reports and attention records."""
    raw = tiny_config(
        str(out),
        model=_MODEL,
        distributed=distributed,
        checkpoint={"enabled": True, "save_consolidated": True},
        logging={"layout_report": "all"},
    )
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(raw))
    ranks = run_on_ranks(_cli_train_on_rank, world_size=world_size, args=(str(path),), timeout_s=_TIMEOUT)
    assert [r["code"] for r in ranks] == [0] * world_size
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    consolidated = out / "checkpoints" / "step_3" / "consolidated"
    params = {k: v for f in sorted(consolidated.glob("*.safetensors")) for k, v in load_file(f).items()}
    reports = [json.loads((out / "layout" / f"rank_{r}.json").read_text()) for r in range(world_size)]
    return {"records": records, "params": params, "reports": reports, "ranks": ranks}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = _train(tmp_path_factory.mktemp("one") / "run", world_size=1, strategy="fsdp2")
    assert run["ranks"][0]["seen"] == []  # the toy is not in this run
    return run


@pytest.mark.parametrize("sq_size", [2, 4])
def test_recipes_train_under_the_toy_axis_matches_one_process(
    sq: None, sq_size: int, one_process: dict[str, Any], tmp_path: Path
) -> None:
    run = _train(tmp_path / "run", world_size=4, strategy="sq_fsdp2", sq_size=sq_size)
    ref, got = one_process["records"], run["records"]
    assert_losses_close([r["loss"] for r in got], [r["loss"] for r in ref])
    assert_losses_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref])
    assert_losses_close([got[-1]["val_loss"]], [ref[-1]["val_loss"]])
    assert run["params"].keys() == one_process["params"].keys()
    for name, want in one_process["params"].items():
        error = float((run["params"][name] - want).abs().max())
        assert error <= RTOL * float(want.abs().max()), f"{name}: max difference {error:.2e}"
    # the layout was applied: with the toy switched off each of these fails
    seq = TINY["dataset"]["seq_length"]
    for rank, (report, seen) in enumerate(zip(run["reports"], run["ranks"])):
        sizes = report["axis_sizes"]
        assert (sizes["sq"], sizes["dp_shard"], sizes["dp_shard_cp"]) == (sq_size, 4 // sq_size, 4), sizes
        assert report["coordinates"]["sq"] == rank % sq_size
        (part,) = report["parts"]
        assert part["sq_attention"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        # FSDP shards every parameter over dp_shard x sq: the sq ranks hold replicas, not copies
        assert all(sharded_on(info, "dp_shard_cp") for info in part["parameters"].values())
        assert f"[rank {rank}] sq ({sq_size} ranks): all-to-all attention in 2 modules" in summary_lines(
            report, axis_sizes=sizes
        )
        # each call saw 1/sq of the row's tokens, and swapped q, k, v and the output
        assert seen["seen"] and set(seen["seen"]) == {seq // sq_size}, seen["seen"]
        assert seen["swaps"] == 4 * len(seen["seen"])


def test_the_toy_axis_refuses_a_model_whose_heads_it_cannot_split(
    sq: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sq.yaml"
    raw = tiny_config(str(tmp_path / "out"), distributed={"strategy": "sq_fsdp2", "sq_size": 4})
    path.write_text(yaml.safe_dump(raw))
    assert run_cli(["validate", str(path), "--world-size", "4"]) == 2
    assert "distributed.sq_size=4: must divide model num_key_value_heads=2" in capsys.readouterr().err
