"""Every private torch API the package reaches (automodel/mesh/torch_internals.py) is where the
installed torch keeps it: this test fails first, naming the API, when a torch release moves one."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import automodel.mesh
from automodel.mesh import torch_internals as ti
from automodel.testing.private_torch import private_torch_uses
from automodel.testing.ranks import run_on_ranks

SRC = Path(automodel.mesh.__file__).parent

#: private attribute names of torch objects (torch_internals holds the accessors)
PRIVATE_ATTRIBUTES = (
    "_flatten",
    "_pg_registry",
    "_get_fsdp_state",
    "_fsdp_param_groups",
    "_parameters",
    "_modules",
    "_buffers",
    ti.CHECKPOINT_WRAPPED,
    ti.COMPILED_ORIGINAL,
    ti.FSDP1_WRAPPED,
)


def test_the_installed_torch_release_is_a_checked_one() -> None:
    """A new torch release is added to CHECKED_TORCH only after `nox -s torch_range` passed on it."""
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release in ti.CHECKED_TORCH, (
        f"torch {torch.__version__} is not among the releases automodel.mesh was checked on "
        f"({ti.CHECKED_TORCH}); run `nox -s torch_range` on it and add it to torch_internals.CHECKED_TORCH"
    )


def test_no_other_module_uses_a_private_torch_name() -> None:
    """torch_internals is the one home: no other module imports or reads a private torch name."""
    assert private_torch_uses(SRC, attributes=PRIVATE_ATTRIBUTES) == {}


def _mesh_internals() -> dict:
    """On a (2, 2) mesh of 4 gloo ranks: flatten, a shard's offset, and the group registry."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    flat = ti.flatten_mesh(mesh["a", "b"], "ab")
    t = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0), Shard(1)])
    return {
        "flat": (flat.mesh_dim_names, flat.size(), mesh["ab"].size()),
        "offset": ti.global_offset(t),
        "registry": ti.clear_process_group_registry(mesh),
        "rank": dist.get_rank(),
    }


def test_mesh_internals_are_where_checked() -> None:
    results = run_on_ranks(_mesh_internals, world_size=4)
    offsets = {r["rank"]: r["offset"] for r in results}
    assert offsets == {0: [0, 0], 1: [0, 1], 2: [2, 0], 3: [2, 1]}
    assert all(r["flat"] == (("ab",), 4, 4) for r in results)
    assert all(r["registry"] for r in results), "DeviceMesh._pg_registry moved"


def _unused_gradient_reduction() -> str:
    from torch.distributed.fsdp import fully_shard

    unit = fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1,)))
    if hasattr(unit, "set_reduce_scatter_unused_params"):  # torch >= 2.13: the public setter
        return "public"
    ti.reduce_unused_gradients_as_zeros(unit)
    cast(nn.Module, unit)(torch.ones(1, 2)).sum().backward()
    return "private"


def test_unused_gradient_reduction_is_where_checked() -> None:
    """torch < 2.13: the zero-filling post-backward attaches and runs (test_unused_parameters in
    automodel-fsdp2 checks the gradients)."""
    (how,) = run_on_ranks(_unused_gradient_reduction, world_size=1)
    release = tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert how == ("private" if release < (2, 13) else "public")


def test_the_fake_backend_is_registered_by_the_store() -> None:
    assert isinstance(ti.fake_store(), dist.Store)
    assert "fake" in dist.Backend.backend_list


def test_wrapper_attribute_names() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    assert isinstance(getattr(checkpoint_wrapper(nn.Linear(2, 2)), ti.CHECKPOINT_WRAPPED), nn.Linear)
    assert isinstance(getattr(torch.compile(nn.Linear(2, 2)), ti.COMPILED_ORIGINAL), nn.Linear)


def test_a_moved_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    class Bare:
        pass

    with pytest.raises(ti.TorchInternalsMoved, match=r"moved DeviceMesh\._flatten.*torch_internals\.py"):
        ti.flatten_mesh(cast(DeviceMesh, Bare()), "x")
    assert ti.clear_process_group_registry(cast(DeviceMesh, Bare())) is False
