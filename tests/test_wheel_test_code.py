"""No published wheel holds test code: scripts/dists.py's check (run by `nox -s install_alone`) on
sample wheels, and the dev-only harness package is no distribution.

The samples are wheels as uv_build writes them (a zip of ``automodel/<pkg>/*.py``): the mesh
package's real sources pass; the same with any piece of the harness (packages/testing) put back,
under its own name or another, fails.
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MESH_SRC = ROOT / "packages" / "mesh" / "src"
HARNESS = ROOT / "packages" / "testing" / "src" / "automodel" / "testing"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


dists = _load("dists")
release_check = _load("release_check")


def _wheel(tmp_path: Path, extra: dict[str, str]) -> Path:
    """A wheel of the mesh package's sources plus `extra` ({path in the wheel: text})."""
    wheel = tmp_path / "automodel_mesh-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path in sorted(MESH_SRC.rglob("*.py")):
            z.write(path, path.relative_to(MESH_SRC).as_posix())
        z.writestr("automodel_mesh-0.1.0.dist-info/METADATA", "Name: automodel-mesh\n")
        for name, text in extra.items():
            z.writestr(name, text)
    return wheel


def test_the_mesh_sources_hold_no_test_code(tmp_path: Path) -> None:
    assert dists.wheel_test_code(_wheel(tmp_path, {})) == []


@pytest.mark.parametrize("module", sorted(p.stem for p in HARNESS.glob("*.py") if p.stem != "__init__"))
def test_a_harness_module_put_back_fails(tmp_path: Path, module: str) -> None:
    """Each harness module, back in the mesh wheel under its old name or its own, is found."""
    text = (HARNESS / f"{module}.py").read_text()
    for name in (f"automodel/mesh/{module}.py", "automodel/mesh/testing.py", "automodel/mesh/helpers.py"):
        found = dists.wheel_test_code(_wheel(tmp_path, {name: text}))
        assert found and all(f.startswith(name) for f in found), (name, found)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("import pytest\n", "imports pytest"),
        ("from _pytest.fixtures import fixture\nimport pytest.mark\n", "imports pytest.mark"),
        (
            "def f():\n    from automodel.testing.ranks import run_on_ranks\n",
            "imports automodel.testing.ranks",
        ),
        ("def run_on_ranks(fn, world_size):\n    pass\n", "defines the harness's run_on_ranks"),
        ("class RankFailure(Exception):\n    pass\n", "defines the harness's RankFailure"),
    ],
)
def test_test_code_under_another_name_fails(tmp_path: Path, text: str, why: str) -> None:
    found = dists.wheel_test_code(_wheel(tmp_path, {"automodel/mesh/helpers.py": text}))
    assert any(why in f for f in found), found


@pytest.mark.parametrize("name", ["automodel/mesh/conftest.py", "automodel/mesh/test_sizes.py"])
def test_test_modules_by_name_fail(tmp_path: Path, name: str) -> None:
    assert dists.wheel_test_code(_wheel(tmp_path, {name: "x = 1\n"})) == [
        f"{name}: a test module by its name"
    ]


def test_the_harness_package_is_no_distribution() -> None:
    """packages/testing is a workspace member, but never built, installed alone or released."""
    assert (ROOT / "packages" / "testing" / "pyproject.toml").is_file()
    assert "automodel-testing" not in {p.name for p in dists.workspace_packages()}
    assert "automodel-testing" not in {p.name for p in release_check.read_packages(ROOT)}
    assert "automodel-mesh" in {p.name for p in dists.workspace_packages()}
