"""A package's version and the torch / transformers range it supports, checked at import.

The one home of this rule for every automodel package (each depends on automodel-mesh); a
package's ``_version.py`` names its distribution and calls `Distribution.checked_version`.
Standard library only, so it runs before anything else of the package.

Single source: the version and the supported ranges are those of the package's pyproject.toml,
read from the installed distribution's metadata (`importlib.metadata`), or from pyproject.toml
itself when the package runs from a source tree on PYTHONPATH (as on the GPU runners).

A torch (or, where transformers is a hard dependency, a transformers) older than the declared
minimum fails the import with an ImportError saying what is needed; a version at or past the
declared upper bound, or an optional transformers outside its range, only warns. Pre-release and
local builds count as their release (``2.11.0a0+git1234`` is 2.11.0), so vendor builds pass.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
import warnings
from pathlib import Path

CHECKED = ("torch", "transformers")
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*?)\s*(?:;\s*(.*))?$")


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: '2.11.0a0+cu130' -> (2, 11, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def _cmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return (a > b) - (a < b)


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


class Distribution:
    """One automodel distribution, located by the ``src/automodel/<pkg>/_version.py`` that names it."""

    def __init__(self, name: str, version_file: str) -> None:
        self.name = name
        self._version_file = Path(version_file).resolve()

    def _pyproject(self) -> dict | None:
        """The package's pyproject.toml when running from its source tree (src/automodel/<pkg>/)."""
        path = self._version_file.parents[3] / "pyproject.toml"
        if not path.is_file():
            return None

        data = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
        return data if data.get("name") == self.name else None

    def version(self) -> str:
        try:
            return importlib.metadata.version(self.name)
        except importlib.metadata.PackageNotFoundError:
            project = self._pyproject()
            return str(project["version"]) if project else "0+unknown"

    def _requirements(self) -> list[str]:
        """Requirement strings (extras' requirements carry an `extra ==` marker)."""
        try:
            return list(importlib.metadata.requires(self.name) or [])
        except importlib.metadata.PackageNotFoundError:
            project = self._pyproject() or {}
            reqs = list(project.get("dependencies", []))
            for extra, deps in project.get("optional-dependencies", {}).items():
                reqs += [f'{d}; extra == "{extra}"' for d in deps]
            return reqs

    def supported_ranges(self) -> dict[str, tuple[str, bool]]:
        """{name: (specifier, required)} for torch and transformers as this distribution declares them."""
        out: dict[str, tuple[str, bool]] = {}
        for req in self._requirements():
            m = _REQ.match(req)
            if m is None or m.group(1).lower() not in CHECKED:
                continue
            name, spec, marker = m.group(1).lower(), m.group(2).replace(" ", ""), m.group(3) or ""
            required = "extra" not in marker
            if name not in out or required:
                out[name] = (spec, required)
        return out

    def problems(self, name: str, found: str, spec: str) -> tuple[str | None, str | None]:
        """(too_old, too_new): why `found` is below the minimum / at or past the upper bound of `spec`."""
        too_old = too_new = None
        have = _release(found)
        for clause in filter(None, spec.split(",")):
            op, bound = re.match(r"(>=|<=|==|!=|~=|>|<)?(.*)", clause).groups()
            want = _release(bound)
            if not want:
                continue
            if (op in (">=", "~=") and _cmp(have, want) < 0) or (op == ">" and _cmp(have, want) <= 0):
                too_old = f"{name} {found} is older than {op}{bound}"
            if (op == "<" and _cmp(have, want) >= 0) or (op == "<=" and _cmp(have, want) > 0):
                too_new = (
                    f"{name} {found} is at or past {op}{bound}, which {self.name} has not been tested with"
                )
        return too_old, too_new

    def checked_version(self) -> str:
        """The version; raises ImportError for a too-old torch (or required transformers), warns for the rest."""
        version = self.version()
        for name, (spec, required) in self.supported_ranges().items():
            found = _installed(name)
            if found is None:
                continue  # a missing hard dependency fails on its own import, with its own message
            too_old, too_new = self.problems(name, found, spec)
            hint = f"{self.name} {version} supports {name}{spec}"
            if too_old and required:
                raise ImportError(f"{too_old}: {hint}; install a supported one: pip install '{name}{spec}'")
            for why in (too_old, too_new):
                if why:
                    warnings.warn(f"{why} ({hint})", RuntimeWarning, stacklevel=4)
        return version
