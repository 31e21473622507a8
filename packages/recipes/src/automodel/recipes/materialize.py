"""Materialize a meta-device (and possibly sharded) model with a layout-independent init.

Every parameter's full value is drawn from a generator seeded by (seed, its FQN), then each rank
keeps only its own shard (`distribute_tensor` with no source rank slices locally). The values are
therefore the same on 1 process and on any FSDP/TP/PP/EP layout, which is what makes the
single-process parity tests of the recipes meaningful. Non-persistent buffers (rotary inv_freq)
are recomputed by constructing the module again.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")


def canonical_fqn(name: str) -> str:
    """The FQN without wrapper prefixes added by activation checkpointing, compile or DDP."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _full_init(fqn: str, shape: torch.Size, dtype: torch.dtype, *, seed: int, std: float) -> torch.Tensor:
    leaf = fqn.rsplit(".", 1)[-1]
    if "norm" in fqn and len(shape) == 1 and leaf == "weight":
        return torch.ones(shape, dtype=dtype)
    if leaf == "bias" or len(shape) < 2:
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63))
    return torch.randn(shape, generator=g, dtype=torch.float32).mul_(std).to(dtype)


@torch.no_grad()
def materialize_model(module: nn.Module, *, device: torch.device, seed: int, std: float = 0.02) -> None:
    """Allocate on `device` and fill every parameter with its layout-independent initial value."""
    module.to_empty(device=device)
    for name, param in module.named_parameters():
        fqn = canonical_fqn(name)
        if isinstance(param, DTensor):
            full = _full_init(fqn, param.shape, param.dtype, seed=seed, std=std).to(device)
            local = distribute_tensor(
                full, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(_full_init(fqn, param.shape, param.dtype, seed=seed, std=std))
    _recompute_buffers(module, device)


def _recompute_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        own = dict(sub.named_buffers(recurse=False))
        if not own or not hasattr(sub, "config"):
            continue
        with torch.device("cpu"):
            fresh = type(sub)(sub.config)
        for name, buf in fresh.named_buffers(recurse=False):
            if name in own:
                own[name].copy_(buf.to(device=device, dtype=own[name].dtype))
