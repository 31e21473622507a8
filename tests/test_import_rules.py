"""Who may import whom (DESIGN.md's table): siblings never import each other nor recipes; recipes
composes them. automodel-data imports no other automodel package, and at module level only the
standard library, torch and numpy: its extras (transformers, pyarrow, datasets, ...) are imported
on first use (`automodel.data.errors.optional`), so it installs and imports with torch and numpy alone.

Source is parsed, never imported.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: package folder -> the automodel sub-packages its src may import (its own included)
MAY_IMPORT = {
    "mesh": {"mesh"},
    "fsdp2": {"fsdp2", "mesh"},
    "megatron-fsdp-adapter": {"megatron_fsdp", "mesh", "fsdp2"},
    "pipeline": {"pipeline", "mesh"},
    "context-parallel": {"context_parallel", "mesh"},
    "moe-ep": {"moe", "mesh"},
    "data": {"data"},
}
#: automodel-data's module-level third-party imports: its two dependencies
DATA_TOP_LEVEL = {"torch", "numpy"}


def imports(path: Path, *, top_level_only: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in `path` (module level only with `top_level_only`)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def automodel_violations(folder: str) -> list[str]:
    allowed = MAY_IMPORT[folder]
    out = []
    for path in sorted((ROOT / "packages" / folder / "src").rglob("*.py")):
        for line, module in imports(path):
            parts = module.split(".")
            if parts[0] == "automodel" and len(parts) > 1 and parts[1] not in allowed:
                out.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    return out


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_package_imports_only_what_it_may(folder: str) -> None:
    assert not automodel_violations(folder)


def test_data_imports_only_torch_and_numpy_at_module_level() -> None:
    src = ROOT / "packages" / "data" / "src"
    files = sorted(src.rglob("*.py"))
    assert len(files) > 20, files
    bad = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in files
        for line, module in imports(path, top_level_only=True)
        if module.split(".")[0] not in sys.stdlib_module_names | DATA_TOP_LEVEL | {"automodel", "__future__"}
    ]
    assert not bad, "automodel-data imports an extra at module level:\n" + "\n".join(bad)


def test_the_rule_flags_a_recipes_import(tmp_path: Path) -> None:
    path = tmp_path / "x.py"
    path.write_text("import os\nfrom automodel.recipes.errors import ConfigError\n")
    assert (2, "automodel.recipes.errors") in imports(path)
