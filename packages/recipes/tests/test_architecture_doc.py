"""docs/architecture.md names only modules, objects and files that exist.

Every backticked name of the page is checked when it looks like one of:

- a dotted name under ``automodel.`` (``automodel.mesh.model_parts``,
  ``automodel.fsdp2.tp_plan.resolve_tp_plan``): the longest importable module prefix is imported
  and the rest looked up as attributes (a dataclass field counts);
- a dotted name whose first part is a module of automodel.recipes (``rules.check_layout_rules``,
  ``data.loader.check_data_paths``): the same, under ``automodel.recipes.``;
- a class or UPPER_CASE constant named without its module (``ResolvedRun``,
  ``Strategy.axis_refusal``): defined at the top level of some package module, attributes looked up;
- a path (it holds ``/`` or ends in ``.py``): a file or folder under the repository root, under
  ``packages/recipes/src/automodel/recipes/`` (the page's shorthand) or under a package's
  ``src/automodel/`` (``fsdp2/config.py``); ``path: name`` also needs ``name`` defined in the file,
  and ``dir/module.name`` (``data/file_check.check_text_rows``) an attribute of the module.

Names of other kinds (YAML values, commands, functions named without their module) are not checked.

Some statements are checked against the code itself: the counts table against the registries, and
the table of the guards the ranks run again against the appliers' source.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "architecture.md"
RECIPES = ROOT / "packages" / "recipes" / "src" / "automodel" / "recipes"
PATH_ROOTS = (ROOT, RECIPES, *sorted((ROOT / "packages").glob("*/src/automodel")))
#: Where a bare file name (``sections.py``) is looked for.
SEARCHED = ("packages", "tests", "docs", "scripts")
FILE_SUFFIXES = ("py", "md", "toml", "yaml", "json")
#: Backticked dotted names that are not modules: attribute paths inside a Hugging Face model.
NOT_NAMES = frozenset({"model.layers", "transformer.h"})
#: A class or constant named without its module (``ResolvedRun``, ``Strategy.axis_refusal``,
#: ``parallel_axes``): it must be defined at the top level of some package module.
CLASSLIKE = re.compile(r"^[A-Z][A-Za-z0-9_]*(\.[A-Za-z_]\w*)*$")
TOP_LEVEL = re.compile(r"^(?:class\s+([A-Z]\w*)|([A-Z][A-Z0-9_]*)\s*[:=])", re.M)
DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+$")


def backticked(text: str) -> list[str]:
    """The page's backticked names, in order, without repeats."""
    return list(dict.fromkeys(re.findall(r"`([^`\n]+)`", text)))


def _lookup(obj: object, name: str) -> object:
    if hasattr(obj, name):
        return getattr(obj, name)
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        fields = {f.name: f for f in dataclasses.fields(obj)}
        if name in fields:
            return fields[name]
    raise AttributeError(f"{getattr(obj, '__name__', obj)!r} has no {name!r}")


def resolve_dotted(name: str) -> object:
    """The object `name` (``package.module.Object.attr``) names; ImportError / AttributeError if none."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module_name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            continue
        obj: object = importlib.import_module(module_name)
        for attr in parts[cut:]:
            obj = _lookup(obj, attr)
        return obj
    raise ImportError(f"no module in {name!r}")


def _defined_in(path: Path, name: str) -> bool:
    source = path.read_text()
    return (
        re.search(rf"^\s*(def|class)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=]", source, re.M)
        is not None
    )


def _module_of(path: Path) -> str:
    """The dotted module name of a source file under one of the packages' ``src/``."""
    src = next(p for p in path.parents if p.name == "src")
    return ".".join(path.relative_to(src).with_suffix("").parts)


@functools.cache
def defined_names() -> dict[str, list[str]]:
    """Top-level classes and UPPER_CASE constants of every package's sources -> their modules."""
    names: dict[str, list[str]] = {}
    for path in sorted((ROOT / "packages").glob("*/src/automodel/**/*.py")):
        for match in TOP_LEVEL.finditer(path.read_text()):
            names.setdefault(match.group(1) or match.group(2), []).append(_module_of(path))
    return names


def _find_path(path: str) -> Path | None:
    """`path` under a root; a bare file name (``sections.py``) anywhere in the sources and tests."""
    for root in PATH_ROOTS:
        if (root / path).exists():
            return root / path
    if "/" not in path:
        for top in SEARCHED:
            found = next((f for f in (ROOT / top).rglob(path) if ".venv" not in f.parts), None)
            if found is not None:
                return found
    return None


def _check_dotted(token: str, name: str) -> str | None:
    try:
        resolve_dotted(name)
    except (ImportError, AttributeError) as e:
        return f"{token}: {e}"
    return None


def check_name(token: str) -> str | None:
    """Why `token` names nothing (None when it exists or is not a checked kind of name)."""
    token = token.strip()
    if token in NOT_NAMES:
        return None
    if (
        "/" in token
        or token.endswith(".py")
        or (DOTTED.match(token) and token.rpartition(".")[2] in FILE_SUFFIXES)
    ):
        path, _, name = (part.strip() for part in token.partition(":"))
        if " " in path or "<" in path or "(" in path:
            return None  # prose, a command or a pattern, not a path
        found = _find_path(path)
        if found is not None:
            if name and not _defined_in(found, name):
                return f"{token}: {name!r} is not defined in {found.relative_to(ROOT)}"
            return None
        head, _, attr = path.rpartition(".")  # dir/module.name
        module = _find_path(head + ".py") if "/" in head else None
        if module is not None and attr:
            return _check_dotted(token, f"{_module_of(module)}.{attr}")
        return f"{token}: no such file or folder"
    if DOTTED.match(token) and token.startswith("automodel."):
        return _check_dotted(token, token)
    if CLASSLIKE.match(token) and not hasattr(builtins, token.split(".")[0]):
        first, _, rest = token.partition(".")
        homes = defined_names().get(first)
        if not homes:
            return f"{token}: {first!r} is defined in no package's sources"
        problems = [_check_dotted(token, f"{home}.{token}") for home in homes]
        return None if None in problems else problems[0]
    first = token.split(".")[0]
    if DOTTED.match(token) and ((RECIPES / first).with_suffix(".py").is_file() or (RECIPES / first).is_dir()):
        return _check_dotted(token, f"automodel.recipes.{token}")
    return None


def test_every_named_module_object_and_file_exists() -> None:
    problems = [p for p in map(check_name, backticked(DOC.read_text())) if p is not None]
    assert not problems, "docs/architecture.md names what does not exist:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "bad",
    [
        "automodel.mesh.no_such_module",
        "automodel.fsdp2.tp_plan.no_such_function",
        "rules.no_such_rule",
        "data.loader.no_such_check",
        "planning/no_such_file.py",
        "planning/search.py: no_such_function",
        "data/file_check.no_such_check",
        "fsdp2/no_such_config.py",
        "NoSuchStrategy",
        "Strategy.no_such_hook",
        "NO_SUCH_AXES",
    ],
)
def test_the_check_catches_a_bad_name(bad: str) -> None:
    assert check_name(bad) is not None


def test_the_check_passes_good_names() -> None:
    for good in (
        "automodel.mesh.model_parts",
        "automodel.mesh.ParallelismSizes.resolve",
        "rules.check_layout_rules",
        "ParallelModel.strategy",  # a dataclass field without a default
        "Strategy.axis_refusal",
        "parallel_axes",
        "ValueError",  # a builtin: not checked
        "planning/search.py: enumerate_layouts",
        "data/file_check.check_text_rows",
        "fsdp2/config.py",
        "recipes/strategies/",
    ):
        assert check_name(good) is None, good


# ---- statements checked against the code, not only the names ----------------------------------

#: A call that refuses: ``check_*`` / ``validate_*`` (private ones too) and ``*_or_refuse``.
GUARD = re.compile(r"^_?(check|validate)_\w+$|\w+_or_refuse$")


def _table(section: str) -> list[list[str]]:
    """The rows of the page's table between ``<!-- <section>: start -->`` and ``... end -->``."""
    text = DOC.read_text()
    body = text.split(f"<!-- {section}: start -->", 1)[1].split(f"<!-- {section}: end -->", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("|")][2:]  # past the header
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def guards_called(source: str) -> set[str]:
    """The names of the guards `source` calls (a function's or a class's)."""
    tree = ast.parse(textwrap.dedent(source))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            if GUARD.match(name):
                names.add(name)
    return names


def test_the_ranks_package_guards_are_the_appliers_own() -> None:
    """Every guard the page lists for an applier the ranks call is called in it, and every guard it
    calls is listed (the ones reached through another listed helper are named in parentheses)."""
    rows = _table("rank guards")
    assert len(rows) >= 6
    for applier, guards in rows:
        (name,) = re.findall(r"`([^`]+)`", applier)
        listed = re.findall(r"`([^`]+)`", guards.split("(", 1)[0])
        called = guards_called(inspect.getsource(resolve_dotted(name)))  # type: ignore[arg-type]
        assert set(listed) == called, (name, sorted(called))


def test_the_guard_scan_sees_calls_not_definitions() -> None:
    source = "def f(x):\n    check_a(x)\n    m._validate_b(x)\n    y = tree_or_refuse(x)\n    checked(x)\n"
    assert guards_called(source) == {"check_a", "_validate_b", "tree_or_refuse"}


def test_the_counts_table_matches_the_registries() -> None:
    from automodel.mesh import axes
    from automodel.recipes.data.kinds import kinds
    from automodel.recipes.parallelisms import parallelisms
    from automodel.recipes.strategies import strategy_names

    counts = {row[0]: row[1] for row in _table("counts")}
    rows = axes()
    by_mesh = {m: [a.name for a in rows if a.mesh == m] for m in ("dense", "flattened", "moe")}
    count, listed = counts["strategies"].split(": ", 1)
    assert (int(count), set(listed.split(", "))) == (len(strategy_names()), set(strategy_names()))
    names = [p.name for p in parallelisms()]
    assert counts["parallelisms"] == f"{len(names)}, in registration order: {', '.join(names)}"
    assert counts["mesh axes"] == (
        f"{len(rows)}: {len(by_mesh['dense'])} dense ({', '.join(by_mesh['dense'])}), "
        f"{len(by_mesh['flattened'])} flattened ({', '.join(by_mesh['flattened'])}), "
        f"{len(by_mesh['moe'])} MoE ({', '.join(by_mesh['moe'])})"
    )
    kind_names = [k.name for k in kinds()]
    assert counts["dataset kinds"] == f"{len(kind_names)}: {', '.join(kind_names)}"
