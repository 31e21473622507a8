"""Every private torch API this package uses, in one place, each with the torch versions checked.

torch has no public way to flatten mesh dims into one named dim, to free a destroyed mesh's
groups, to read a DTensor shard's global offset, or to register its single-process `fake` backend;
so these names are reached here and nowhere else. Each accessor fails with `TorchInternalsMoved`
(naming the torch version and this module) instead of an `AttributeError` far from the cause, and
`tests/test_torch_internals.py` checks every one against the installed torch.

Checked on torch 2.11, 2.13, 2.14 and 2.15 (`nox -s torch_range`):

- `DeviceMesh._flatten(name)`: all versions (no public flatten).
- `DeviceMesh._pg_registry` (a root mesh's dict of its groups): all versions.
- `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`: all versions.
- `torch.testing._internal.distributed.fake_pg.FakeStore`: importing it registers the `fake`
  backend (`init_process_group("fake")` fails without it on every checked torch).
- Before torch 2.13 FSDP2 has no `set_reduce_scatter_unused_params`: `reduce_unused_gradients_as_zeros`
  gives the unit's trainable parameters without a gradient a zero one at the start of its
  parameter group's `post_backward`, through `FSDPModule._get_fsdp_state()._fsdp_param_group`
  (`.post_backward`, `.fsdp_params`, each with `_unsharded_param`, `unsharded_accumulated_grad`):
  checked on 2.11 (2.13 and later use the public setter).
- Wrapper attribute names a module's FQNs may carry: `_checkpoint_wrapped_module` (torch's
  checkpoint wrapper), `_orig_mod` (`torch.compile`), `_fsdp_wrapped_module` (FSDP1).

Replaced by public APIs: FSDP2's `_get_fsdp_state()._fsdp_param_groups` (absent on 2.11) by the
unit's DTensor parameters' `device_mesh`; `nn.Module._parameters` by
`named_parameters(recurse=False, remove_duplicate=False)`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = [
    "reduce_unused_gradients_as_zeros",
    "CHECKED_TORCH",
    "CHECKPOINT_WRAPPED",
    "COMPILED_ORIGINAL",
    "FSDP1_WRAPPED",
    "TorchInternalsMoved",
    "clear_process_group_registry",
    "fake_store",
    "flatten_mesh",
    "global_offset",
]

#: torch releases (major.minor) on which every accessor below was run by the package's tests
CHECKED_TORCH = ("2.11", "2.13", "2.14", "2.15")

#: the attribute torch's checkpoint wrapper keeps the wrapped module under
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
#: the attribute a `torch.compile`d module keeps the original module under
COMPILED_ORIGINAL = "_orig_mod"
#: the attribute FSDP1 keeps the wrapped module under
FSDP1_WRAPPED = "_fsdp_wrapped_module"


class TorchInternalsMoved(RuntimeError):
    """A private torch API this package relies on is not where any checked torch kept it."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"torch {torch.__version__} moved {what}, a private torch API that automodel.mesh "
            f"relies on (checked on torch {', '.join(CHECKED_TORCH)}; see "
            "automodel/mesh/torch_internals.py). Install a checked torch or update that module"
        )


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """`mesh`'s dims as one dim called `name` (registered on the root, so `root[name]` finds it)."""
    flatten = getattr(mesh, "_flatten", None)
    if flatten is None:
        raise TorchInternalsMoved("DeviceMesh._flatten")
    return flatten(name)


def clear_process_group_registry(mesh: DeviceMesh) -> bool:
    """Drop the process groups `mesh` keeps, so destroyed groups can be freed; False where this
    torch keeps none there (teardown then only warns about the threads left, see
    `free_process_groups`; the package's test fails on such a torch)."""
    registry = getattr(mesh, "_pg_registry", None)
    if not isinstance(registry, dict):
        return False
    registry.clear()
    return True


def global_offset(t: DTensor) -> list[int]:
    """Where this rank's shard of `t` starts in the global tensor, per dim."""
    try:
        # lazy: private torch API (a torch that moved it fails this accessor, not the import)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as err:
        raise TorchInternalsMoved(
            "torch.distributed.tensor._utils.compute_local_shape_and_global_offset"
        ) from err
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return [int(o) for o in offset]


def fake_store() -> dist.Store:
    """A store for `init_process_group("fake", ...)`; importing it registers the `fake` backend."""
    try:
        # lazy: private torch API (a torch that moved it fails this accessor, not the import)
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as err:
        raise TorchInternalsMoved("torch.testing._internal.distributed.fake_pg.FakeStore") from err
    return FakeStore()


def reduce_unused_gradients_as_zeros(unit: FSDPModule) -> None:
    """torch < 2.13: what `set_reduce_scatter_unused_params(True, recurse=False)` does on later
    torch (a trainable parameter that got no gradient joins the reduce-scatter as zeros)."""
    state = unit._get_fsdp_state()
    if not hasattr(state, "_fsdp_param_group"):
        raise TorchInternalsMoved("FSDPModule._get_fsdp_state()._fsdp_param_group")
    group = state._fsdp_param_group
    if group is None:  # a unit without parameters of its own
        return
    post_backward = getattr(group, "post_backward", None)
    if post_backward is None or not isinstance(getattr(group, "fsdp_params", None), list):
        raise TorchInternalsMoved("FSDPParamGroup.post_backward / fsdp_params")
    if getattr(post_backward, "_zero_fills_unused", False):
        return

    def zero_filling_post_backward(*args: Any) -> Any:
        for fsdp_param in group.fsdp_params:
            if (
                not hasattr(fsdp_param, "_unsharded_param")
                or fsdp_param.unsharded_accumulated_grad is not None
            ):
                continue
            param = fsdp_param.unsharded_param
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)  # a DTensor under TP, as its gradient would be
        return post_backward(*args)

    zero_filling_post_backward._zero_fills_unused = True  # pyright: ignore[reportFunctionMemberAccess]
    group.post_backward = zero_filling_post_backward
