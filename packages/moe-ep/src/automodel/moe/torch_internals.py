"""Every private torch API this package uses, in one place, each with the torch versions checked.

torch has no public autograd-aware uneven all-to-all, and no public way to copy a module without
its hooks; so these are reached here and nowhere else. Each accessor fails with
`TorchInternalsMoved` (naming the torch version and this module) instead of an `ImportError` or a
silently hooked copy, and `tests/test_torch_internals.py` checks every one against the installed
torch.

Checked on torch 2.11, 2.13, 2.14 and 2.15 (`nox -s torch_range`):

- `torch.distributed._functional_collectives.all_to_all_single_autograd(x, output_split_sizes,
  input_split_sizes, group)`: all versions.
- `nn.Module`'s instance layout, for `hook_free_copy`: `_parameters`, `_modules`, the hook
  registries in `MODULE_HOOKS` (every `*hooks*` dict a fresh module holds) and
  `_compiled_call_impl` (set by `Module.compile`): all versions.

Replaced by public APIs: `torch._grouped_mm` by `torch.nn.functional.grouped_mm` (2.11 and later),
`nn.Module._parameters` reads by `get_parameter` / `named_parameters(recurse=False, ...)`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "CHECKED_TORCH",
    "MODULE_HOOKS",
    "TorchInternalsMoved",
    "all_to_all_single_autograd",
    "hook_free_copy",
]

#: torch releases (major.minor) on which every accessor below was run by the package's tests
CHECKED_TORCH = ("2.11", "2.13", "2.14", "2.15")

#: nn.Module's per-instance hook registries: a hook-free copy starts with them empty.
MODULE_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


class TorchInternalsMoved(RuntimeError):
    """A private torch API this package relies on is not where any checked torch kept it."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"torch {torch.__version__} moved {what}, a private torch API that automodel.moe "
            f"relies on (checked on torch {', '.join(CHECKED_TORCH)}; see "
            "automodel/moe/torch_internals.py). Install a checked torch or update that module"
        )


def all_to_all_single_autograd(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Uneven all-to-all of the rows of `x` whose backward is the reverse all-to-all."""
    try:
        # lazy: private torch API (a torch that moved it fails this accessor, not the import)
        from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a
    except ImportError as err:
        raise TorchInternalsMoved(
            "torch.distributed._functional_collectives.all_to_all_single_autograd"
        ) from err
    return a2a(x, out_splits, in_splits, group)


def hook_free_copy(module: nn.Module, params: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of `module` with `params` (dotted names: copies of the descendants holding
    them) as parameters; none of the copies carries the original's hooks, an instance-level
    ``forward`` override or a compiled call (those are bound to the original)."""
    state = module.__dict__
    if not isinstance(state.get("_parameters"), dict) or not isinstance(state.get("_modules"), dict):
        raise TorchInternalsMoved("nn.Module._parameters / _modules")
    own = {n: p for n, p in params.items() if "." not in n}
    by_child: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in params.items():
        if "." in name:
            child, rest = name.split(".", 1)
            by_child.setdefault(child, {})[rest] = p
    view = object.__new__(type(module))
    view.__dict__.update(state)
    view.__dict__.pop("forward", None)
    view.__dict__.pop("_compiled_call_impl", None)
    for hooks in MODULE_HOOKS:
        if hooks in view.__dict__:
            view.__dict__[hooks] = type(view.__dict__[hooks])()
    view.__dict__["_parameters"] = {**state["_parameters"], **own}
    children = {n: hook_free_copy(state["_modules"][n], sub) for n, sub in by_child.items()}
    view.__dict__["_modules"] = {**state["_modules"], **children}
    return view
