"""Every private torch API this package uses, in one place, each with the torch versions checked.

DCP has no public way to rebuild a state dict from a checkpoint's metadata without a process
group, nor a public metadata path or nested setter; the LR scheduler has no setter for what
`get_last_lr()` reports; the float64 multi-tensor norm and inductor's config have no public home.
So these names are reached here and nowhere else. Each accessor fails with `TorchInternalsMoved`
(naming the torch version and this module) instead of an `AttributeError` far from the cause, and
`tests/test_torch_internals.py` checks every one against the installed torch.

Checked on torch 2.11, 2.13, 2.14 and 2.15 (`nox -s torch_range`):

- `torch.distributed.checkpoint.state_dict_loader._load_state_dict(..., no_dist=True)`,
  `default_planner._EmptyStateDictLoadPlanner`, `_traverse.set_element` and
  `FileSystemReader._get_metadata_path(rank)`: all versions.
- `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`: all versions.
- `torch._foreach_norm(tensors, ord, dtype=...)`: all versions.
- `torch._inductor.config.emulate_precision_casts`: all versions.
- `LRScheduler._last_lr` (what `get_last_lr()` returns): all versions.
- the logger name of `torch.utils._pytree` (`PYTREE_LOGGER`): all versions.

Replaced by public APIs: `nn.Module._modules` by `get_submodule`, `named_children` and `setattr`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "CHECKED_TORCH",
    "PYTREE_LOGGER",
    "EmptyStateDictLoadPlanner",
    "TorchInternalsMoved",
    "emulate_precision_casts",
    "foreach_norms",
    "load_state_dict_in_one_process",
    "local_shape_and_global_offset",
    "metadata_path",
    "set_element",
    "set_last_lr",
]

#: torch releases (major.minor) on which every accessor below was run by the package's tests
CHECKED_TORCH = ("2.11", "2.13", "2.14", "2.15")

#: the logger torch's pytree module logs its notices on
PYTREE_LOGGER = "torch.utils._pytree"


class TorchInternalsMoved(RuntimeError):
    """A private torch API this package relies on is not where any checked torch kept it."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"torch {torch.__version__} moved {what}, a private torch API that automodel.recipes "
            f"relies on (checked on torch {', '.join(CHECKED_TORCH)}; see "
            "automodel/recipes/torch_internals.py). Install a checked torch or update that module"
        )


def _empty_state_dict_load_planner() -> type[DefaultLoadPlanner]:
    try:
        # lazy: private torch API (a torch that moved it fails this accessor, not the import)
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    except ImportError as err:
        raise TorchInternalsMoved(
            "torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner"
        ) from err
    return _EmptyStateDictLoadPlanner


#: torch's load planner that rebuilds the whole state dict from the checkpoint's metadata
EmptyStateDictLoadPlanner = _empty_state_dict_load_planner()


def set_element(root: dict[str, Any], path: Any, value: Any) -> None:
    """Put `value` at `path` (an object path as DCP flattens it) inside the nested `root`."""
    try:
        # lazy: private torch API (a torch that moved it fails this accessor, not the import)
        from torch.distributed.checkpoint._traverse import set_element as set_at
    except ImportError as err:
        raise TorchInternalsMoved("torch.distributed.checkpoint._traverse.set_element") from err
    set_at(root, path, value)


def metadata_path(reader: FileSystemReader, rank: int | None) -> Any:
    """Where `reader` finds the checkpoint's ``.metadata`` file."""
    get = getattr(reader, "_get_metadata_path", None)
    if get is None:
        raise TorchInternalsMoved("FileSystemReader._get_metadata_path")
    return get(rank)


def load_state_dict_in_one_process(
    state: dict[str, Any], *, reader: StorageReader, planner: LoadPlanner
) -> None:
    """DCP's load into `state` without a process group (`dcp.load` would load into a copy)."""
    try:
        # lazy: private torch API (a torch that moved it fails this accessor, not the import)
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError as err:
        raise TorchInternalsMoved("torch.distributed.checkpoint.state_dict_loader._load_state_dict") from err
    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)


def local_shape_and_global_offset(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard of `t`: its shape and where it starts in the global tensor."""
    try:
        # lazy: private torch API (a torch that moved it fails this accessor, not the import)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as err:
        raise TorchInternalsMoved(
            "torch.distributed.tensor._utils.compute_local_shape_and_global_offset"
        ) from err
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def foreach_norms(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The L2 norm of each tensor, accumulated in `dtype` by one multi-tensor kernel."""
    norm = getattr(torch, "_foreach_norm", None)
    if norm is None:
        raise TorchInternalsMoved("torch._foreach_norm")
    return list(norm(tensors, 2, dtype=dtype))


def emulate_precision_casts() -> None:
    """Make inductor round like eager at each cast (torchao's advice for rowwise float8)."""
    # lazy: start-up, torch._inductor.config ~1.9 s, fp8 only
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "emulate_precision_casts"):
        raise TorchInternalsMoved("torch._inductor.config.emulate_precision_casts")
    inductor_config.emulate_precision_casts = True


def set_last_lr(scheduler: LRScheduler, values: list[float]) -> None:
    """What `scheduler.get_last_lr()` reports until its next step."""
    if not isinstance(getattr(scheduler, "_last_lr", None), list):
        raise TorchInternalsMoved("LRScheduler._last_lr")
    scheduler._last_lr = list[float | torch.Tensor](values)
