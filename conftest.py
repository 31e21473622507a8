"""Workspace-wide pytest set-up: warm imports for forked ranks; `gpu` tests skip without CUDA.

The skip decision never initialises CUDA in the pytest process (`cuda_probe` asks a child
interpreter): GPU tests launch their ranks through torchrun, and CPU tests fork gloo ranks, which
a process with an initialised CUDA driver cannot do safely.
"""

from __future__ import annotations

import pytest

# Import once here, before tests fork their ranks: otherwise the first backward with an explicit
# gradient imports sympy (via symbolic_shapes) separately in every forked rank (13-30 s each on 2 cores).
import torch.fx.experimental.symbolic_shapes  # noqa: F401

from automodel.testing.ranks import cuda_probe


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return  # no probe (a child interpreter, ~2-3 s) when no gpu test was collected
    count, why = cuda_probe()
    if count > 0:
        return
    skip = pytest.mark.skip(
        reason=f"needs CUDA ({why}); run `nox -s gpu_tests` or scripts/gpu_check.sh on a GPU"
    )
    for item in gpu_items:
        item.add_marker(skip)
