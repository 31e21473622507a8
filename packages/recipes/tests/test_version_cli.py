"""`recipes --version`: every automodel package, torch, transformers and megatron-fsdp."""

from __future__ import annotations

import importlib.metadata

import pytest

from automodel.recipes.cli import AUTOMODEL_DISTRIBUTIONS, run_cli


def test_version_lists_every_package_and_the_frameworks(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split(" ", 1)[0] for line in lines]
    assert names == [*AUTOMODEL_DISTRIBUTIONS, "torch", "transformers", "megatron-fsdp"]
    assert len(AUTOMODEL_DISTRIBUTIONS) == 8
    for name, line in zip(names, lines):
        assert line == f"{name} {importlib.metadata.version(name)}"


def test_version_says_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name in ("megatron-fsdp", "automodel-moe-ep"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert run_cli(["--version", "train", "x.yaml"]) == 0  # --version wins, nothing runs
    out = capsys.readouterr().out
    assert "megatron-fsdp not installed" in out.splitlines()
    assert "automodel-moe-ep not installed" in out.splitlines()
