"""Every private torch API the package reaches (automodel/megatron_fsdp/torch_internals.py) is where
the installed torch keeps it: this test fails first, naming the API, when a torch release moves one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import automodel.megatron_fsdp
from automodel.megatron_fsdp import torch_internals as ti
from automodel.megatron_fsdp.checkpointing import apply_mlp_checkpointing
from automodel.testing.private_torch import private_torch_uses

SRC = Path(automodel.megatron_fsdp.__file__).parent


def test_the_installed_torch_release_is_a_checked_one() -> None:
    """A new torch release is added to CHECKED_TORCH only after `nox -s torch_range` passed on it."""
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release in ti.CHECKED_TORCH, (
        f"torch {torch.__version__} is not among the releases automodel.megatron_fsdp was checked on "
        f"({ti.CHECKED_TORCH}); run `nox -s torch_range` on it and add it to torch_internals.CHECKED_TORCH"
    )


def test_no_other_module_uses_a_private_torch_name() -> None:
    """torch_internals is the one home: no other module imports or reads a private torch name."""
    assert private_torch_uses(SRC, attributes=(ti.CHECKPOINT_WRAPPED, "_modules", "_parameters")) == {}


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def test_checkpoint_wrapper_is_where_checked() -> None:
    model = nn.Sequential(_Layer(), _Layer())
    keys = list(model.state_dict())
    assert apply_mlp_checkpointing(model, unit_modules=[_Layer]) == 2
    assert isinstance(getattr(model[0].mlp, ti.CHECKPOINT_WRAPPED), nn.Linear)
    assert list(model.state_dict()) == keys
    x = torch.randn(2, 3, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None


def test_a_moved_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", None)
    with pytest.raises(
        ti.TorchInternalsMoved, match=r"moved torch\.distributed\.algorithms.*torch_internals\.py"
    ):
        ti.non_reentrant_checkpoint_wrapper(nn.Linear(1, 1))
