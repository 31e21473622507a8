"""This package's version, single-sourced from its pyproject.toml (the installed metadata, else the
source tree's pyproject). automodel-data depends on torch and numpy alone, so it does not import
`automodel.mesh.versioning`; its torch range is the declared one (`torch_range` tests both ends)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path


def _version() -> str:
    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    if pyproject.is_file():  # a source checkout (the workspace): the tree's version, not a stale install
        return tomllib.loads(pyproject.read_text())["project"]["version"]
    return importlib.metadata.version("automodel-data")


__version__ = _version()
