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
    ("sections.py", "single"),  # dataloader.dataloader_type, NeMo AutoModel's value
    ("launch.py", "single"),  # automodel.mesh.LaunchEnv.launcher: no torchrun / srun
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
