"""Versions single-sourced per package, and the torch / transformers check each package runs at import."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "mesh": "mesh",
    "fsdp2": "fsdp2",
    "megatron-fsdp-adapter": "megatron_fsdp",
    "pipeline": "pipeline",
    "context-parallel": "context_parallel",
    "moe-ep": "moe",
    "recipes": "recipes",
}


def _project(folder: str) -> dict:
    return tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())["project"]


def _version_file(folder: str) -> Path:
    return ROOT / "packages" / folder / "src" / "automodel" / PACKAGES[folder] / "_version.py"


def _load_copy(folder: str, name: str):
    """Execute a package's _version.py afresh (as module `name`), running its import-time check."""
    spec = importlib.util.spec_from_file_location(name, _version_file(folder))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_package_names_its_distribution_and_shares_one_check() -> None:
    """One home for the rule (automodel.mesh.versioning); each _version.py only names its distribution."""
    for folder in PACKAGES:
        text = _version_file(folder).read_text()
        assert "from automodel.mesh.versioning import Distribution" in text, folder
        name = re.search(r'^distribution = Distribution\("([^"]+)", __file__\)$', text, re.M).group(1)
        assert name == _project(folder)["name"], folder


@pytest.mark.parametrize("folder", list(PACKAGES))
def test_dunder_version_is_the_pyproject_version(folder: str) -> None:
    module = importlib.import_module(f"automodel.{PACKAGES[folder]}")
    assert module.__version__ == _project(folder)["version"]
    assert module.__version__ == importlib.metadata.version(_project(folder)["name"])


@pytest.mark.parametrize("folder", list(PACKAGES))
def test_declared_ranges_accept_the_gpu_runners_and_the_lock(folder: str) -> None:
    v = _load_copy(folder, f"_version_probe_{PACKAGES[folder]}").distribution
    ranges = v.supported_ranges()
    spec, required = ranges["torch"]
    assert required and spec.startswith(">=2.11"), ranges
    for torch_version in ("2.11.0", "2.11.0a0+gitabc", "2.11.0+cu130", "2.13.0", "2.13.0+cu130"):
        assert v.problems("torch", torch_version, spec) == (None, None), torch_version
    assert v.problems("torch", "2.10.2", spec)[0] == "torch 2.10.2 is older than >=2.11"
    if folder not in ("mesh", "megatron-fsdp-adapter"):  # neither declares transformers
        spec, required = ranges["transformers"]
        assert required == (folder == "recipes"), ranges
        for tf_version in ("5.17.0", "5.17.0.dev0", "5.23.0"):
            assert v.problems("transformers", tf_version, spec) == (None, None), tf_version


def _fake_versions(monkeypatch: pytest.MonkeyPatch, **fake: str) -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        return fake.get(name.replace("-", "_"), None) or real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_too_old_torch_fails_the_import_with_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_versions(monkeypatch, torch="2.9.1")
    with pytest.raises(ImportError) as e:
        _load_copy("pipeline", "_version_old_torch")
    assert str(e.value) == (
        "torch 2.9.1 is older than >=2.11: automodel-pipeline 0.1.0 supports torch>=2.11,<2.16; "
        "install a supported one: pip install 'torch>=2.11,<2.16'"
    ).replace("0.1.0", _project("pipeline")["version"])


def test_newer_torch_and_optional_transformers_only_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_versions(monkeypatch, torch="3.0.0", transformers="5.10.0")
    with pytest.warns(RuntimeWarning) as record:
        _load_copy("pipeline", "_version_new_torch")
    messages = sorted(str(w.message) for w in record)
    assert messages[0].startswith("torch 3.0.0 is at or past <2.16"), messages
    assert messages[1].startswith("transformers 5.10.0 is older than >=5.17"), messages


def test_recipes_requires_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_versions(monkeypatch, transformers="5.10.0")
    with pytest.raises(ImportError, match=r"transformers 5\.10\.0 is older than >=5\.17"):
        _load_copy("recipes", "_version_old_transformers")


def test_supported_versions_import_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for folder in PACKAGES:
            _load_copy(folder, f"_version_quiet_{PACKAGES[folder]}")


def test_source_tree_without_metadata_reads_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU runners put src/ on PYTHONPATH without installing: pyproject.toml is the fallback."""
    real_version, real_requires = importlib.metadata.version, importlib.metadata.requires

    def missing(fn):
        def wrapped(name: str):
            if name.startswith("automodel-"):
                raise importlib.metadata.PackageNotFoundError(name)
            return fn(name)

        return wrapped

    monkeypatch.setattr(importlib.metadata, "version", missing(real_version))
    monkeypatch.setattr(importlib.metadata, "requires", missing(real_requires))
    v = _load_copy("moe-ep", "_version_from_tree")
    assert v.__version__ == _project("moe-ep")["version"]
    assert v.distribution.supported_ranges() == {
        "torch": (">=2.11,<2.16", True),
        "transformers": (">=5.17,<6", False),
    }


def test_data_package_reads_its_version_without_mesh() -> None:
    """automodel-data depends on torch and numpy alone, so its _version.py cannot use
    automodel.mesh.versioning: it reads the same version, and declares the siblings' torch range."""
    module = importlib.import_module("automodel.data")
    assert module.__version__ == _project("data")["version"] == importlib.metadata.version("automodel-data")
    assert "from automodel.mesh" not in _version_file_of("data").read_text()
    assert "torch>=2.11,<2.16" in _project("data")["dependencies"]
    assert "torch>=2.11,<2.16" in _project("pipeline")["dependencies"]


def _version_file_of(folder: str) -> Path:
    return ROOT / "packages" / folder / "src" / "automodel" / folder / "_version.py"
