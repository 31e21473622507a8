"""Where a package's source reaches a private torch API outside its `torch_internals.py`.

Each package keeps every private torch API in one module (`automodel.<pkg>.torch_internals`) and
its `tests/test_torch_internals.py` asserts that no other module uses one; this is the reader
those tests share. It parses the source (comments and docstrings do not count) and reports
imports of private torch modules or names, `torch._x` attributes, and the private attribute
names a package lists (e.g. ``_flatten``), used as attributes or as string constants.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

__all__ = ["private_torch_uses"]


def _private_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "torch" and any(p.startswith("_") for p in parts[1:])


def _private_attr(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _uses(tree: ast.AST, attributes: frozenset[str]) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if _private_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            if _private_module(module):
                found.append(f"from {module} import ...")
            found += [f"from {module} import {a.name}" for a in node.names if _private_attr(a.name)]
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "torch" and _private_attr(node.attr):
                found.append(f"torch.{node.attr}")
            elif node.attr in attributes:
                found.append(f".{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in attributes:
            found.append(repr(node.value))
    return found


def private_torch_uses(src: Path, *, attributes: Iterable[str] = ()) -> dict[str, list[str]]:
    """Per module file under `src` (its `torch_internals.py` excepted), the private torch uses found."""
    names = frozenset(attributes)
    out: dict[str, list[str]] = {}
    for path in sorted(src.rglob("*.py")):
        if path.name == "torch_internals.py":
            continue
        uses = _uses(ast.parse(path.read_text(), filename=str(path)), names)
        if uses:
            out[str(path.relative_to(src))] = uses
    return out
