"""Every private torch API this package uses, in one place, each with the torch versions checked.

torch has no public module wrapper for activation checkpointing (`torch.utils.checkpoint` has the
function only), so its private wrapper is reached here and nowhere else. The accessor fails with
`TorchInternalsMoved` (naming the torch version and this module) instead of an `ImportError` at
import time, and `tests/test_torch_internals.py` checks it against the installed torch.

Checked on torch 2.11, 2.13, 2.14 and 2.15 (`nox -s torch_range`):

- `torch.distributed.algorithms._checkpoint.checkpoint_wrapper` (`checkpoint_wrapper`,
  `CheckpointImpl.NO_REENTRANT`) and the attribute it keeps the module under,
  `_checkpoint_wrapped_module`: all versions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["CHECKED_TORCH", "CHECKPOINT_WRAPPED", "TorchInternalsMoved", "non_reentrant_checkpoint_wrapper"]

#: torch releases (major.minor) on which every accessor below was run by the package's tests
CHECKED_TORCH = ("2.11", "2.13", "2.14", "2.15")

#: the attribute torch's checkpoint wrapper keeps the wrapped module under
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"


class TorchInternalsMoved(RuntimeError):
    """A private torch API this package relies on is not where any checked torch kept it."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"torch {torch.__version__} moved {what}, a private torch API that automodel.megatron_fsdp "
            f"relies on (checked on torch {', '.join(CHECKED_TORCH)}; see "
            "automodel/megatron_fsdp/torch_internals.py). Install a checked torch or update that module"
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
