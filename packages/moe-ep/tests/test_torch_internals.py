"""Every private torch API the package reaches (automodel/moe/torch_internals.py) is where the
installed torch keeps it: this test fails first, naming the API, when a torch release moves one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import automodel.moe
from automodel.moe import torch_internals as ti
from automodel.testing.private_torch import private_torch_uses
from automodel.testing.ranks import run_on_ranks

SRC = Path(automodel.moe.__file__).parent


def test_the_installed_torch_release_is_a_checked_one() -> None:
    """A new torch release is added to CHECKED_TORCH only after `nox -s torch_range` passed on it."""
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release in ti.CHECKED_TORCH, (
        f"torch {torch.__version__} is not among the releases automodel.moe was checked on "
        f"({ti.CHECKED_TORCH}); run `nox -s torch_range` on it and add it to torch_internals.CHECKED_TORCH"
    )


def test_no_other_module_uses_a_private_torch_name() -> None:
    """torch_internals is the one home: no other module imports or reads a private torch name."""
    private = ("_parameters", "_modules", "_buffers", "_compiled_call_impl", *ti.MODULE_HOOKS)
    assert private_torch_uses(SRC, attributes=private) == {}


def test_module_hook_registries_are_the_checked_ones() -> None:
    """A hook registry torch adds would survive into a hook-free copy: it must be listed."""
    state = vars(nn.Linear(2, 2))
    call_hooks = {
        k
        for k, v in state.items()
        if isinstance(v, dict) and "hook" in k and ("forward" in k or "backward" in k)
    }
    assert call_hooks == set(ti.MODULE_HOOKS)
    assert isinstance(state["_parameters"], dict) and isinstance(state["_modules"], dict)


def test_hook_free_copy_is_where_checked() -> None:
    outer = nn.Sequential(nn.Linear(2, 2, bias=False))
    outer.register_forward_hook(lambda *_: pytest.fail("the original's hook ran on the copy"))
    outer[0].register_forward_pre_hook(lambda *_: pytest.fail("the original's hook ran on the copy"))
    outer.compile()
    assert "_compiled_call_impl" in vars(outer)
    eye = torch.eye(2)
    view = ti.hook_free_copy(outer, {"0.weight": eye})
    x = torch.randn(3, 2)
    assert torch.equal(view(x), x)
    assert "_compiled_call_impl" not in vars(view)
    assert outer[0].weight is not eye and view.get_submodule("0").weight is eye


def _a2a_on_two_ranks() -> tuple[list[float], list[float]]:
    rank = dist.get_rank()
    # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 rows to rank 0 and 1 to itself
    in_splits = [[1, 2], [3, 1]][rank]
    out_splits = [[1, 3], [2, 1]][rank]
    x = (torch.arange(sum(in_splits), dtype=torch.float32) + 10 * rank).unsqueeze(1).requires_grad_()
    y = ti.all_to_all_single_autograd(x, out_splits, in_splits, dist.group.WORLD)
    (y * (torch.arange(y.shape[0]) + 1).unsqueeze(1)).sum().backward()
    assert x.grad is not None
    return y.squeeze(1).tolist(), x.grad.squeeze(1).tolist()


def test_all_to_all_single_autograd_is_where_checked() -> None:
    (y0, g0), (y1, g1) = run_on_ranks(_a2a_on_two_ranks, world_size=2)
    assert y0 == [0.0, 10.0, 11.0, 12.0] and y1 == [1.0, 2.0, 13.0]
    # each row's gradient is its position (1-based) on the receiving rank
    assert g0 == [1.0, 1.0, 2.0] and g1 == [2.0, 3.0, 4.0, 3.0]


def test_a_moved_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed._functional_collectives", None)
    with pytest.raises(
        ti.TorchInternalsMoved, match=r"moved .*all_to_all_single_autograd.*torch_internals\.py"
    ):
        ti.all_to_all_single_autograd(torch.zeros(1), [1], [1], None)
