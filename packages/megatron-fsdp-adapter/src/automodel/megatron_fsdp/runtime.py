"""Lazy import of megatron-fsdp, with a clear message where it cannot run."""

from __future__ import annotations

import warnings
from types import ModuleType

import torch


class MegatronFSDPUnavailableError(RuntimeError):
    """megatron-fsdp cannot run here (no CUDA, or the package is missing)."""


def import_megatron_fsdp() -> ModuleType:
    """The `megatron_fsdp` module, imported only when sharding actually happens.

    megatron-fsdp installs anywhere (pure Python) but its constructor allocates CUDA streams and
    buffers, so without CUDA it would fail deep inside; we fail first, and say what to do.
    """
    if not torch.cuda.is_available():
        raise MegatronFSDPUnavailableError(
            "strategy megatron_fsdp needs CUDA: megatron-fsdp allocates CUDA streams and buffers when it "
            "wraps the model, and torch.cuda.is_available() is False on this machine. Use strategy fsdp2 "
            "(which runs on CPU), or run on a GPU machine."
        )
    try:
        with warnings.catch_warnings():
            # "Transformer Engine and Apex are not installed": expected, it falls back to torch ops.
            warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
            # lazy: optional dependency (megatron-fsdp, CUDA only)
            import megatron_fsdp
    except ImportError as err:
        raise MegatronFSDPUnavailableError(
            "strategy megatron_fsdp needs the megatron-fsdp package: pip install megatron-fsdp "
            f"(import failed: {err})"
        ) from err
    return megatron_fsdp
