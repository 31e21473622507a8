"""A mesh axis is named only by the code that owns it (issue 50's "Done when").

Outside `automodel.recipes.parallelisms` (each parallelism's own module), the recipes may name a mesh
axis (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, the flattened ``dp``, ``dp_shard_cp``,
``dp_cp``, the MoE mesh's ``ep_shard``, ``ep``; read off the axis table, `automodel.mesh.axes`) or a
parallelism's size key (``tp_size``) in exactly three places:

- a strategy's allow-list, ``supported_axes = (...)`` in `strategies/` (which parallelisms it
  composes: the one thing a strategy must say by name);
- the YAML translation, `compat/` (NeMo AutoModel's keys, which name axes, mapped to ours);
- the axis table itself, which is `automodel.mesh.axes`, outside this package.

Everything else asks the registry: the parallelisms' hooks and flags (`Parallelism`), the mesh
roles (`parallelisms.roles`), the axis table's functions. What is scanned: the code of every module
(names, attributes, parameters, keyword arguments, definitions, imports, and string literals that
are one identifier, as in ``get_mesh("cp")`` or ``sizes["tp_size"]``), where an axis name is a whole
``_``-separated part of the word (``cp_backend`` names cp, ``kept`` names nothing). Docstrings,
comments and prose strings (messages with spaces) are not code and may say anything. Neither are
the keywords of a call to another package's function (imported from outside `automodel.recipes`,
as ``build_loader(dp_rank=...)`` of `automodel.data`, not the standard library's): they are that
package's API, which the recipes call, not a name the recipes choose.

The scan finds nothing: every name it found when it was written has moved behind a hook, a flag or
a role.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from automodel.mesh import axes
from automodel.recipes.parallelisms import parallelisms

SRC = Path(__file__).resolve().parents[1] / "src" / "automodel" / "recipes"
#: Where axes may be named: the parallelisms' own modules and the YAML translation (`compat/`).
OWNERS = ("parallelisms", "compat")
#: The class attribute of a strategy that lists the parallelisms it composes.
ALLOW_LIST = "supported_axes"


def axis_words() -> frozenset[str]:
    """Every mesh axis of the table and every registered parallelism's name and size key."""
    rows = axes()
    return frozenset(
        {a.name for a in rows}
        | {a.size_key for a in rows if a.size_key}
        | {p.name for p in parallelisms()}
        | {p.size_key for p in parallelisms()}
    )


def names_an_axis(word: str, words: frozenset[str]) -> str | None:
    """The axis (or size key) `word` names as a whole ``_``-separated run of its parts, else None."""
    parts = word.split("_")
    for length in range(len(parts), 0, -1):
        for start in range(len(parts) - length + 1):
            run = "_".join(parts[start : start + length])
            if run in words:
                return run
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    """The string statements (module, class, function and attribute docstrings)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def _allow_list_values(tree: ast.AST) -> set[int]:
    """The nodes of ``supported_axes = ...`` assignments (a strategy's allow-list)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if (
                any(isinstance(t, ast.Name) and t.id == ALLOW_LIST for t in targets)
                and node.value is not None
            ):
                found |= {id(n) for n in ast.walk(node.value)}
    return found


def _imported_from_elsewhere(tree: ast.AST) -> set[str]:
    """The names a module binds by importing from another package: outside `automodel.recipes` and
    outside the standard library (whose generic helpers, like ``dataclasses.replace``, take the
    recipes' own names as keywords)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if _another_package(node.module):
                names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {
                alias.asname or alias.name.split(".")[0]
                for alias in node.names
                if _another_package(alias.name)
            }
    return names


def _another_package(module: str) -> bool:
    top = module.split(".")[0]
    in_recipes = module == "automodel.recipes" or module.startswith("automodel.recipes.")
    return not in_recipes and top not in sys.stdlib_module_names


def _foreign_call_keywords(tree: ast.AST) -> set[int]:
    """The keywords of calls to another package's function (`_imported_from_elsewhere`, called by
    its name or as an attribute of its module): that package's API, not the recipes' names."""
    foreign = _imported_from_elsewhere(tree)
    found: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        root = node.func
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in foreign:
            found |= {id(k) for k in node.keywords}
    return found


def code_words(source: str) -> list[str]:
    """The identifiers a module's code uses, and its one-identifier string literals (see above)."""
    tree = ast.parse(source)
    skipped = _docstrings(tree) | _allow_list_values(tree) | _foreign_call_keywords(tree)
    words: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, ast.arg):
            words.append(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            words.append(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            words.append(node.name)
        elif isinstance(node, ast.alias):
            words += (node.asname or node.name).split(".")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", node.value):
                words += node.value.split(".")
    return words


def named_axes(root: Path) -> dict[tuple[str, str], str]:
    """(module, word) -> the axis it names, for every module under `root` outside the owners."""
    words = axis_words()
    found: dict[tuple[str, str], str] = {}
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        if module.split("/")[0] in OWNERS:
            continue
        for word in code_words(path.read_text()):
            axis = names_an_axis(word, words)
            if axis is not None:
                found[(module, word)] = axis
    return found


def test_outside_the_parallelisms_no_module_names_a_mesh_axis() -> None:
    found = named_axes(SRC)
    assert len(list(SRC.rglob("*.py"))) > 100  # the scan reads the package
    assert sorted(found) == []  # ask the registry (a hook, a flag, a role) instead


def test_the_scan_finds_axis_names_in_code_and_not_in_prose() -> None:
    words = axis_words()
    assert {
        "pp",
        "dp_replicate",
        "dp_shard",
        "cp",
        "tp",
        "dp",
        "dp_shard_cp",
        "dp_cp",
        "ep_shard",
        "ep",
    } <= words
    assert {"tp_size", "cp_size", "ep_size", "pp_size"} <= words
    assert names_an_axis("cp_backend", words) == "cp"
    assert names_an_axis("dp_shard_cp", words) == "dp_shard_cp"
    assert names_an_axis("sequence_divisor", words) is None
    assert names_an_axis("kept", words) is None
    source = '''
"""A module that says tp and cp in its docstring."""
from automodel.data.api import build_loader
from automodel.recipes.mine import own
import dataclasses
build_loader(dp_rank=0)
own(tp_rank=0)
dataclasses.replace(own, pp_rank=0)
class S:
    supported_axes = ("dp_shard", "tp")
    def f(self, layout, mesh):
        """Uses ep."""
        n = layout.tp * layout.axis_size("ep")
        raise ValueError("the pp ranks disagree")
        return mesh.get_mesh("cp"), cp_size, {"dp_shard_cp": n}
'''
    hits = {w for w in code_words(source) if names_an_axis(w, words)}
    assert hits == {"tp", "tp_rank", "pp_rank", "ep", "cp", "cp_size", "dp_shard_cp"}
