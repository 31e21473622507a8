"""Workspace-wide pytest set-up: warm imports for forked ranks; `gpu` tests skip without CUDA.

The skip decision never initialises CUDA in the pytest process (`cuda_probe` asks a child
interpreter): GPU tests launch their ranks through torchrun, and CPU tests fork gloo ranks, which
a process with an initialised CUDA driver cannot do safely.
"""

from __future__ import annotations

import os

import pytest
import torch

# Import once here, before tests fork their ranks: otherwise the first backward with an explicit
# gradient imports sympy (via symbolic_shapes) separately in every forked rank (13-30 s each on 2 cores).
import torch.fx.experimental.symbolic_shapes  # noqa: F401

from automodel.testing.ranks import cuda_probe
from automodel.testing.torch_rules import names_a_v_schedule, v_schedules_run_on_gloo


def _skip_v_schedules_where_torch_cannot(items: list[pytest.Item]) -> None:
    """A case parametrized with a V-shape schedule is skipped on a torch that cannot set one up over
    gloo (2.11; see automodel.testing.torch_rules); the refusal itself is tested on its own."""
    if v_schedules_run_on_gloo():
        return
    skip = pytest.mark.skip(
        reason=f"V-shape schedules cannot be set up over gloo on torch {torch.__version__}"
    )
    for item in items:
        callspec = getattr(item, "callspec", None)
        values = list(callspec.params.values()) if callspec is not None else []
        values += [v for d in values if isinstance(d, dict) for v in d.values()]  # a case's settings
        if any(names_a_v_schedule(v) for v in values) or (
            callspec is not None and names_a_v_schedule(callspec.id)
        ):
            item.add_marker(skip)


#: `nox -s heavy` sets it: the `heavy`-marked cases run (the CPU suite skips them, naming the session).
RUN_HEAVY = os.environ.get("AUTOMODEL_HEAVY") == "1"


def _skip_heavy_cases(items: list[pytest.Item]) -> None:
    if RUN_HEAVY:
        return
    skip = pytest.mark.skip(reason="heavy CPU case: run by `nox -s heavy` (AUTOMODEL_HEAVY=1)")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_v_schedules_where_torch_cannot(items)
    _skip_heavy_cases(items)
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
