"""No import circle among the recipes' modules, read off their source (no module is imported).

Every import counts: at module level, inside a function (a lazy import only defers a circle to run
time) and under ``TYPE_CHECKING`` (a circle the type checker walks is one a refactor turns into a
run-time one). Importing ``a.b.c`` from outside ``a.b`` also runs ``a/b/__init__``, so that edge
counts too: a package's ``__init__`` that imports its modules eagerly puts every importer of one of
them on a path through the others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import automodel.recipes

PACKAGE = "automodel.recipes"
ROOT = Path(automodel.recipes.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join([PACKAGE, *parts])] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The recipes module `name` is (or is inside: ``pkg.mod.attr`` -> ``pkg.mod``), None outside."""
    while name not in modules:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The recipes modules `module` imports, anywhere in its source."""
    targets: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import name`: the module pkg.name when there is one, else pkg itself
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        for name in names:
            target = _resolve(name, modules) if name.startswith(PACKAGE) else None
            if target is None:
                continue
            targets.add(target)
            parts = target.split(".")
            for i in range(len(PACKAGE.split(".")) + 1, len(parts)):  # the packages around it
                ancestor = ".".join(parts[:i])
                if ancestor in modules and not module.startswith(ancestor + "."):
                    targets.add(ancestor)
    targets.discard(module)
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imported(module, path, modules) for module, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circle_among_the_recipes_modules() -> None:
    graph = import_graph()
    assert len(graph) > 100 and f"{PACKAGE}.trainer" in graph  # the walk found the package
    assert circles(graph) == []


def test_the_walk_finds_a_circle_through_a_lazy_import_and_a_package_init() -> None:
    """The checker can fail: the circle `planning/__init__` once hid behind a lazy import."""
    graph = {k: set(v) for k, v in import_graph().items()}
    graph[f"{PACKAGE}.planning"].add(f"{PACKAGE}.planning.admit")  # an eager import in __init__
    graph[f"{PACKAGE}.parallelisms.base"].add(f"{PACKAGE}.planning.memory")
    (circle,) = circles(graph)
    assert f"{PACKAGE}.planning" in circle and f"{PACKAGE}.parallelisms" in circle


def test_planning_init_imports_nothing() -> None:
    assert import_graph()[f"{PACKAGE}.planning"] == set()
