"""Workspace-wide pytest set-up: warm imports for forked ranks; `gpu` tests skip without CUDA."""

from __future__ import annotations

import pytest
import torch

# Import once here, before tests fork their ranks: otherwise the first backward with an explicit
# gradient imports sympy (via symbolic_shapes) separately in every forked rank (13-30 s each on 2 cores).
import torch.fx.experimental.symbolic_shapes  # noqa: E402,F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs CUDA (torch.cuda.is_available() is False); run `nox -s gpu_tests` on a GPU"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
