"""Every private torch API the package reaches (automodel/recipes/torch_internals.py) is where the
installed torch keeps it: this test fails first, naming the API, when a torch release moves one."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import automodel.recipes
from automodel.recipes import torch_internals as ti
from automodel.recipes.checkpoint.safe_dcp import SafeEmptyStateDictLoadPlanner, SafeFileSystemReader
from automodel.testing.private_torch import private_torch_uses
from automodel.testing.ranks import run_on_ranks

SRC = Path(automodel.recipes.__file__).parent

#: private attribute names of torch objects (torch_internals holds the accessors)
PRIVATE_ATTRIBUTES = (
    "_modules",
    "_parameters",
    "_buffers",
    "_last_lr",
    "_get_metadata_path",
    "emulate_precision_casts",
    ti.PYTREE_LOGGER,
)


def test_the_installed_torch_release_is_a_checked_one() -> None:
    """A new torch release is added to CHECKED_TORCH only after `nox -s torch_range` passed on it."""
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release in ti.CHECKED_TORCH, (
        f"torch {torch.__version__} is not among the releases automodel.recipes was checked on "
        f"({ti.CHECKED_TORCH}); run `nox -s torch_range` on it and add it to torch_internals.CHECKED_TORCH"
    )


def test_no_other_module_uses_a_private_torch_name() -> None:
    """torch_internals is the one home: no other module imports or reads a private torch name."""
    assert private_torch_uses(SRC, attributes=PRIVATE_ATTRIBUTES) == {}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_internals_are_where_checked(tmp_path: Path) -> None:
    """Save a nested state dict; rebuild it in one process from metadata (the path convert_legacy
    and the safe reader take), non-tensor entries through `set_element`."""
    import torch.distributed.checkpoint as dcp

    saved = {"model": {"w": torch.arange(4.0)}, "extra": {"step": 3, "note": "x"}}
    dcp.save(saved, storage_writer=FileSystemWriter(str(tmp_path)))
    assert Path(ti.metadata_path(FileSystemReader(str(tmp_path)), None)).name == ".metadata"
    state: dict = {}
    ti.load_state_dict_in_one_process(
        state, reader=SafeFileSystemReader(str(tmp_path)), planner=SafeEmptyStateDictLoadPlanner()
    )
    assert torch.equal(state["model"]["w"], torch.arange(4.0))
    assert state["extra"] == {"step": 3, "note": "x"}
    nested: dict = {}
    ti.set_element(nested, ("a", "b"), 1)
    assert nested == {"a": {"b": 1}}


def _offsets() -> tuple:
    t = distribute_tensor(torch.zeros(5, 2), init_device_mesh("cpu", (2,)), [Shard(0)])
    return ti.local_shape_and_global_offset(t)


def test_dtensor_offset_is_where_checked() -> None:
    assert run_on_ranks(_offsets, world_size=2) == [((3, 2), (0, 0)), ((2, 2), (3, 0))]


def test_foreach_norm_and_inductor_config_are_where_checked() -> None:
    norms = ti.foreach_norms([torch.tensor([3.0, 4.0]), torch.ones(4, dtype=torch.bfloat16)], torch.float64)
    assert [n.item() for n in norms] == [5.0, 2.0] and norms[0].dtype == torch.float64
    import torch._inductor.config as inductor_config

    before = inductor_config.emulate_precision_casts
    try:
        ti.emulate_precision_casts()
        assert inductor_config.emulate_precision_casts is True
    finally:
        inductor_config.emulate_precision_casts = before


def test_lr_scheduler_and_pytree_logger_are_where_checked() -> None:
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    ti.set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]
    assert importlib.import_module(ti.PYTREE_LOGGER).__name__ == ti.PYTREE_LOGGER


def test_a_moved_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "_foreach_norm")
    with pytest.raises(ti.TorchInternalsMoved, match=r"moved torch\._foreach_norm.*torch_internals\.py"):
        ti.foreach_norms([torch.ones(1)], torch.float64)
