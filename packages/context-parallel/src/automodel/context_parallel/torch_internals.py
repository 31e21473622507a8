"""Every private torch API this package uses, in one place, each with the torch versions checked.

torch's public `context_parallel()` has no argument for how the KV shards rotate, and torch's
checkpoint wrapper has no public accessor for the module it wraps; so these names are reached here
and nowhere else. Each accessor fails with `TorchInternalsMoved` (naming the torch version and this
module) instead of an `ImportError` inside a training step, and `tests/test_torch_internals.py`
checks every one against the installed torch.

Checked on torch 2.11, 2.13, 2.14 and 2.15 (`nox -s torch_range`):

- `torch.distributed.tensor.experimental._attention.set_rotate_method("alltoall" | "allgather")`:
  all versions (the public `torch.distributed.tensor.experimental.context_parallel` is used for
  the rest).
- `_checkpoint_wrapped_module`, the attribute torch's checkpoint wrapper keeps the module under.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CHECKED_TORCH", "KV_ROTATIONS", "TorchInternalsMoved", "set_kv_rotation", "unwrap_checkpointed"]

#: torch releases (major.minor) on which every accessor below was run by the package's tests
CHECKED_TORCH = ("2.11", "2.13", "2.14", "2.15")

#: the rotations `set_rotate_method` takes
KV_ROTATIONS = ("alltoall", "allgather")


class TorchInternalsMoved(RuntimeError):
    """A private torch API this package relies on is not where any checked torch kept it."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"torch {torch.__version__} moved {what}, a private torch API that automodel.context_parallel "
            f"relies on (checked on torch {', '.join(CHECKED_TORCH)}; see "
            "automodel/context_parallel/torch_internals.py). Install a checked torch or update that module"
        )


def set_kv_rotation(method: str) -> None:
    """How torch's ring attention passes KV shards between the CP ranks (one of `KV_ROTATIONS`)."""
    # lazy: start-up, torch's CP ~2.3 s, CUDA-only path
    try:
        # lazy: private torch API (a torch that moved it fails this accessor, not the import)
        from torch.distributed.tensor.experimental._attention import set_rotate_method
    except ImportError as err:
        raise TorchInternalsMoved(
            "torch.distributed.tensor.experimental._attention.set_rotate_method"
        ) from err
    set_rotate_method(method)


def unwrap_checkpointed(module: nn.Module) -> nn.Module:
    """The module torch's checkpoint wrapper wraps, or `module` itself when it is not wrapped."""
    return getattr(module, "_checkpoint_wrapped_module", module)
