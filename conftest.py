"""Workspace-wide pytest set-up: `gpu`-marked tests skip with the reason on machines without CUDA."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs CUDA (torch.cuda.is_available() is False); run `nox -s gpu_tests` on a GPU"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
