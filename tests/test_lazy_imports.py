"""The one rule for function-local imports in packages/*/src: each says why it is not at module top.

An import inside a function hides a dependency and defers its failures to the first call, so it is
kept only for a reason written next to it as ``# lazy: <reason>`` (on its line or the line above;
one comment may head a run of directly consecutive imports). The reasons:

- ``optional dependency`` -- a package that may be absent (megatron_fsdp, peft, tensorboard, ...);
- ``start-up, <what> ~<figure> s`` -- a measured import cost on a path that does not need it;
- ``cycle <a> -> <b> -> <a>`` -- the import cycle a module-level import would create;
- ``order, <why>`` -- code that must run before the import (in a fresh process or rank);
- ``private torch API`` -- in a package's ``torch_internals.py``: a torch that moved the name fails
  that accessor with ``TorchInternalsMoved``, not the whole package's import.

Source is parsed, never imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REASON = re.compile(
    r"#\s*lazy: (optional dependency\b|private torch API\b|start-up, .*~[\d.]+ m?s\b|cycle \S+ -> \S+|order, \S)"
)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _local_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import | ast.ImportFrom):
                found.append(child)
            walk(child, in_function or isinstance(child, _FUNCS))

    walk(tree, False)
    return found


def missing_reasons(source: str, name: str) -> list[str]:
    """``name:line: import`` for each function-local import without a ``# lazy: <reason>``."""
    lines = source.splitlines()
    ok_ends: set[int] = set()  # last lines of covered imports: the next one directly below is covered
    missing = []
    for node in sorted(_local_imports(ast.parse(source)), key=lambda n: n.lineno):
        above = lines[node.lineno - 2] if node.lineno >= 2 else ""
        covered = (
            REASON.search(lines[node.lineno - 1]) is not None
            or REASON.match(above.strip()) is not None
            or node.lineno - 1 in ok_ends
        )
        if covered:
            ok_ends.add(node.end_lineno or node.lineno)
        else:
            missing.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return missing


def test_every_function_local_import_says_why() -> None:
    files = sorted(ROOT.glob("packages/*/src/**/*.py"))
    assert len(files) > 100, files  # the glob found the sources
    missing = [m for f in files for m in missing_reasons(f.read_text(), str(f.relative_to(ROOT)))]
    assert not missing, "function-local imports without '# lazy: <reason>':\n" + "\n".join(missing)


def test_the_rule_flags_an_unexplained_import() -> None:
    source = """
import os


def unexplained():
    import json
    return json


def explained():
    # lazy: optional dependency
    import peft
    import peft.tuners
    x = 1
    import yaml
    # lazy: start-up, datasets ~0.6 s
    import datasets
    from a import b  # lazy: cycle a -> c -> a
    # lazy: because
    import c
    # lazy: start-up, no figure
    import d
    return peft, datasets, b, yaml, x, c, d


class K:
    def method(self):
        import zlib  # lazy: order, the environment is set first
        return zlib
"""
    assert missing_reasons(source, "s.py") == [
        "s.py:6: import json",
        "s.py:15: import yaml",  # a statement between breaks the run under the comment
        "s.py:20: import c",  # a reason outside the four forms
        "s.py:22: import d",  # start-up without a measured figure
    ]
