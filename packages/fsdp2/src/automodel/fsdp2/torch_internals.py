"""Every private torch API this package uses, in one place, each with the torch versions checked.

torch has no public module wrapper for activation checkpointing, no public switch for async TP,
and extends its colwise/rowwise TP styles only through their private hooks; so these names are
reached here and nowhere else. Each accessor fails with `TorchInternalsMoved` (naming the torch
version and this module) instead of an `AttributeError` far from the cause, and
`tests/test_torch_internals.py` checks every one against the installed torch.

Checked on torch 2.11, 2.13, 2.14 and 2.15 (`nox -s torch_range`):

- `torch.distributed.algorithms._checkpoint.checkpoint_wrapper` (`checkpoint_wrapper`,
  `CheckpointImpl.NO_REENTRANT`) and the attribute it keeps the layer under,
  `_checkpoint_wrapped_module`: all versions (`torch.utils.checkpoint` has the function only).
- Async TP: `torch._inductor.config._micro_pipeline_tp` and
  `torch.distributed._symmetric_memory.enable_symm_mem_for_group(group_name)`: all versions.
- TP style hooks overridden by `tp_shared_styles` / `tp_lora`: `ParallelStyle._apply(module,
  mesh)`, `RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs,
  device_mesh)` (a staticmethod) and `ColwiseParallel/RowwiseParallel._partition_linear_fn(name,
  module, device_mesh)`: same signatures on all versions.

Replaced by public APIs: `nn.Module._modules/_parameters/_buffers` by `named_parameters(recurse=False,
remove_duplicate=False)`, `get_buffer`, `setattr` and `register_module`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import RowwiseParallel

__all__ = [
    "CHECKED_TORCH",
    "CHECKPOINT_WRAPPED",
    "TorchInternalsMoved",
    "enable_async_tp_internals",
    "next_partition_linear",
    "non_reentrant_checkpoint_wrapper",
    "rowwise_prepare_output",
]

#: torch releases (major.minor) on which every accessor below was run by the package's tests
CHECKED_TORCH = ("2.11", "2.13", "2.14", "2.15")

#: the attribute torch's checkpoint wrapper keeps the wrapped module under
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"


class TorchInternalsMoved(RuntimeError):
    """A private torch API this package relies on is not where any checked torch kept it."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"torch {torch.__version__} moved {what}, a private torch API that automodel.fsdp2 "
            f"relies on (checked on torch {', '.join(CHECKED_TORCH)}; see "
            "automodel/fsdp2/torch_internals.py). Install a checked torch or update that module"
        )


def non_reentrant_checkpoint_wrapper(module: nn.Module, **checkpoint_kwargs: Any) -> nn.Module:
    """torch's checkpoint wrapper (non-reentrant) around `module`; its state-dict keys are unchanged."""
    try:
        # lazy: private torch API (a torch that moved it fails this accessor, not the import)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )
    except ImportError as err:
        raise TorchInternalsMoved("torch.distributed.algorithms._checkpoint.checkpoint_wrapper") from err
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **checkpoint_kwargs)


def _async_tp_hooks() -> tuple[Any, Callable[[Any], None]]:
    """Inductor's config module and torch's `enable_symm_mem_for_group`."""
    # lazy: start-up, torch._inductor.config ~1.9 s, async TP only
    import torch._inductor.config as inductor_config

    try:
        # lazy: private torch API (a torch that moved it fails this accessor, not the import)
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    except ImportError as err:
        raise TorchInternalsMoved("torch.distributed._symmetric_memory.enable_symm_mem_for_group") from err
    if not hasattr(inductor_config, "_micro_pipeline_tp"):
        raise TorchInternalsMoved("torch._inductor.config._micro_pipeline_tp")
    return inductor_config, enable_symm_mem_for_group


def enable_async_tp_internals(group_name: str) -> None:
    """Inductor's micro-pipelined TP on, and symmetric memory for the TP group `group_name`."""
    inductor_config, enable_symm_mem_for_group = _async_tp_hooks()
    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group_name)


def rowwise_prepare_output(
    output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any
) -> Any:
    """What `RowwiseParallel` does to a module's output (redistributed; local if asked)."""
    hook = getattr(RowwiseParallel, "_prepare_output_fn", None)
    if hook is None:
        raise TorchInternalsMoved("RowwiseParallel._prepare_output_fn")
    return hook(output_layouts, use_local_output, mod, outputs, device_mesh)


def next_partition_linear(cls: type, style: Any, name: str, module: nn.Module, device_mesh: Any) -> None:
    """The colwise/rowwise partition of `module`'s parameters that `style`'s class after `cls` does."""
    hook = getattr(super(cls, style), "_partition_linear_fn", None)
    if hook is None:
        raise TorchInternalsMoved("ColwiseParallel/RowwiseParallel._partition_linear_fn")
    hook(name, module, device_mesh)
