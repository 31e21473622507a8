"""Wrappers are known by the strategy alone: no strategy name appears as a string outside
`recipes/strategies/` in the recipes' sources (what a wrapper means for checkpoints, exports,
kernels and the layout report is asked of the `Strategy`).

Exempt, by rule rather than by line:

- `compat/`: it translates NeMo AutoModel's YAML (its manager classes) into our YAML, so it writes
  ``distributed.strategy`` values;
- the default of the ``distributed.strategy`` YAML key (``<section>.get("strategy", NAME)``): a
  YAML value, parsed like any other;
- words of other vocabularies that spell a strategy name: ``dataloader_type: single`` (a YAML value
  of NeMo AutoModel's dataloader) and the launcher kind ``"single"`` (`automodel.mesh.LaunchEnv`,
  a process without torchrun or srun). They are listed with their file, so each one is seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

from automodel.recipes.strategies import strategy_names

SRC = Path(__file__).parents[1] / "src" / "automodel" / "recipes"
EXEMPT_DIRS = ("strategies", "compat")
#: (file relative to SRC, the word): another vocabulary's word that spells a strategy name.
OTHER_VOCABULARIES = {
    ("config/sections.py", "single"),  # dataloader.dataloader_type, NeMo AutoModel's value
    ("launch_plan.py", "single"),  # automodel.mesh.LaunchEnv.launcher: no torchrun / srun
}


def _yaml_default_of_strategy(node: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
    """``x.get("strategy", NAME)``: the YAML key's default value."""
    call = parents.get(node)
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "get"
        and len(call.args) == 2
        and call.args[1] is node
        and isinstance(call.args[0], ast.Constant)
        and call.args[0].value == "strategy"
    )


def strategy_name_uses(source: str, *, names: tuple[str, ...]) -> list[tuple[int, str]]:
    """``(line, name)`` of every string constant of `source` that is exactly a strategy name."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and node.value in names
        and not _yaml_default_of_strategy(node, parents)
    ]


def test_no_strategy_name_outside_strategies() -> None:
    names = strategy_names()
    assert {"ddp", "fsdp2", "megatron_fsdp", "single"} <= set(names)
    found, other_words = [], set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] in EXEMPT_DIRS:
            continue
        for line, name in strategy_name_uses(path.read_text(), names=names):
            if (str(rel), name) in OTHER_VOCABULARIES:
                other_words.add((str(rel), name))
            else:
                found.append(f"{rel}:{line}: {name!r}")
    assert not found, "strategy names outside strategies/ (ask the Strategy instead):\n" + "\n".join(found)
    assert other_words == OTHER_VOCABULARIES  # no stale exemption


def test_the_check_catches_a_strategy_name() -> None:
    """The comparisons this replaced, and a YAML default, as the check sees them."""
    names = strategy_names()
    sample = (
        'if cfg.distributed.strategy == "megatron_fsdp":\n'
        "    pass\n"
        'ok = strategy in ("ddp", "fsdp2")\n'
        'default = data.get("strategy", "fsdp2")\n'
        'label = f"distributed.strategy {name}"\n'
    )
    assert strategy_name_uses(sample, names=names) == [(1, "megatron_fsdp"), (3, "ddp"), (3, "fsdp2")]


def _ddp_on_rank() -> tuple[bool, list[str], list[str]]:
    """A DDP-wrapped module: the strategy unwraps it, torch's state dict keeps the user's names,
    and the layout report's DDP line comes from the strategy."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from automodel.recipes.layout_report import describe_part, summary_lines
    from automodel.recipes.strategies import get_strategy

    inner = nn.Sequential(nn.Linear(2, 2))
    wrapped = DistributedDataParallel(inner)
    ddp = get_strategy("ddp")
    report = describe_part(wrapped, strategy=ddp)
    lines = summary_lines({"rank": 0, "strategy": ddp.name, "parts": [report]}, axis_sizes={}, strategy=ddp)
    return ddp.unwrap(wrapped) is inner, sorted(ddp.model_state_dict(wrapped)), lines


def test_each_strategy_knows_its_own_wrapper() -> None:
    """DDP (a real wrapper) and megatron-fsdp (a stand-in with its attributes: it needs CUDA):
    unwrap, the state module and the layout report's entries are the strategy's."""
    from torch import nn

    from automodel.recipes.strategies import get_strategy
    from automodel.testing.ranks import run_on_ranks

    unwrapped, keys, lines = run_on_ranks(_ddp_on_rank, world_size=1)[0]
    assert unwrapped and keys == ["0.bias", "0.weight"]
    assert any(line.startswith("[rank 0] ddp (1 ranks): reducer") for line in lines), lines

    class Buffer:
        is_data_distributed, data_size, dp_world_size = True, 6, 2

    class Group:
        params = [0, 1]
        model_weight_buffer = Buffer()

    class FakeMegatronFSDP(nn.Module):  # what `is_megatron_fsdp` recognises
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module
            self.param_and_grad_buffer = type("B", (), {"parameter_groups": [Group()]})()
            self.swapped = False

        def finish_grad_sync(self) -> None: ...

        def _replace_param_with_distributed_if_needed(self) -> None:
            self.swapped = True

    inner = nn.Linear(2, 2)
    part = FakeMegatronFSDP(inner)
    megatron = get_strategy("megatron_fsdp")
    assert megatron.unwrap(part) is inner and megatron.unwrap(inner) is inner
    assert megatron.state_module(part) is inner and part.swapped
    described = megatron.describe_wrapper(part)
    assert described["megatron_fsdp"]["parameter_groups"][0]["model_weight_buffer"]["local_numel"] == 6
    assert megatron.wrapper_lines(described, rank=3) == ["[rank 3] megatron_fsdp: 1 parameter groups"]
    for name in ("fsdp2", "single", "ddp"):  # no wrapper of theirs: the part itself, nothing to report
        strategy = get_strategy(name)
        assert strategy.unwrap(inner) is inner and strategy.describe_wrapper(inner) == {}
    assert (get_strategy("fsdp2").float8_all_gather, get_strategy("megatron_fsdp").float8_linears) == (
        True,
        False,
    )
