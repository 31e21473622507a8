"""`apply_autocast`: run a model's forward under ``torch.autocast`` (``autocast_dtype``)."""

from __future__ import annotations

import functools

import torch
from torch import nn


def apply_autocast(model: nn.Module, *, dtype: torch.dtype, device_type: str) -> None:
    """Wrap ``model.forward`` in ``torch.autocast(device_type, dtype)`` (matmuls in `dtype`).

    Pair with an ``mp_policy`` whose ``output_dtype`` is fp32 to keep the residual stream in fp32.
    The wrapper is an instance attribute, so module names and state-dict keys are unchanged.
    """
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"autocast device_type must be 'cuda' or 'cpu', got {device_type!r}")
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
