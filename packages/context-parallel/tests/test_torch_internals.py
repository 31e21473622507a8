"""Every private torch API the package reaches (automodel/context_parallel/torch_internals.py) is
where the installed torch keeps it: this test fails first, naming the API, when torch moves one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import automodel.context_parallel
from automodel.context_parallel import torch_internals as ti
from automodel.testing.private_torch import private_torch_uses

SRC = Path(automodel.context_parallel.__file__).parent


def test_the_installed_torch_release_is_a_checked_one() -> None:
    """A new torch release is added to CHECKED_TORCH only after `nox -s torch_range` passed on it."""
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release in ti.CHECKED_TORCH, (
        f"torch {torch.__version__} is not among the releases automodel.context_parallel was checked on "
        f"({ti.CHECKED_TORCH}); run `nox -s torch_range` on it and add it to torch_internals.CHECKED_TORCH"
    )


def test_no_other_module_uses_a_private_torch_name() -> None:
    """torch_internals is the one home: no other module imports or reads a private torch name."""
    assert private_torch_uses(SRC, attributes=("_checkpoint_wrapped_module", "_modules", "_parameters")) == {}


def test_kv_rotation_is_where_checked() -> None:
    from torch.distributed.tensor.experimental._attention import _cp_options

    before = _cp_options.rotate_method
    try:
        for method, name in zip(ti.KV_ROTATIONS, ("ALL_TO_ALL", "ALL_GATHER"), strict=True):
            ti.set_kv_rotation(method)
            assert _cp_options.rotate_method.name == name
    finally:
        _cp_options.rotate_method = before


def test_checkpoint_wrapper_attribute_is_where_checked() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = nn.Linear(2, 2)
    assert ti.unwrap_checkpointed(checkpoint_wrapper(inner)) is inner
    assert ti.unwrap_checkpointed(inner) is inner


def test_a_moved_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor.experimental._attention", None)
    with pytest.raises(
        ti.TorchInternalsMoved, match=r"moved .*_attention\.set_rotate_method.*torch_internals\.py"
    ):
        ti.set_kv_rotation("allgather")
