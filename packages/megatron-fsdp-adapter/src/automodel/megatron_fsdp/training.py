"""What a training loop does differently around a ``MegatronFSDP`` model: micro-batch gradient
sync, and state dicts with uneven shards (for DCP and for full-tensor export)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from automodel.mesh import MeshContext


def is_megatron_fsdp(module: nn.Module) -> bool:
    """True for the wrapper `apply_megatron_fsdp` returns (checked by its buffer, no import)."""
    return hasattr(module, "param_and_grad_buffer") and hasattr(module, "finish_grad_sync")


@contextmanager
def microbatch_grad_sync(model: nn.Module, *, is_last_microbatch: bool) -> Iterator[None]:
    """Backward passes inside accumulate; on the last micro-batch gradients are reduced and attached.

    On the last micro-batch megatron-fsdp reduces the gradient buffer over its dp group and hands
    the reduced shards to the optimizer's parameters as ``.grad`` (``finish_grad_sync``), so the
    gradient norm can be taken before ``optimizer.step()``. Earlier micro-batches keep the local
    sum (no_shard / optim) or reduce-scatter into the shard (optim_grads / optim_grads_params).
    """
    model.is_last_microbatch = is_last_microbatch
    model.model_auto_sync = is_last_microbatch
    try:
        yield
    finally:
        model.is_last_microbatch = True
        model.model_auto_sync = True


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """FQN -> DTensor of the wrapped module (Hugging Face names, no ``module.`` prefix), with the
    chunk metadata DCP needs for megatron-fsdp's uneven shards."""
    # lazy: optional dependency (megatron-fsdp, CUDA only)
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    model._replace_param_with_distributed_if_needed()  # pyright: ignore[reportCallIssue]  # megatron-fsdp's method
    return preprocess_state_dict_for_uneven_dtensor(model.get_submodule("module").state_dict())


def prepare_state_dict_for_dcp(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Attach uneven-shard chunk metadata to every DTensor of `state_dict` (collective)."""
    # lazy: optional dependency (megatron-fsdp, CUDA only)
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    return preprocess_state_dict_for_uneven_dtensor(state_dict)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a megatron-fsdp DTensor (uneven shards gathered; collective)."""
    # lazy: optional dependency (megatron-fsdp, CUDA only)
    from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor

    return uneven_dtensor_to_full_tensor(t) if isinstance(t, DTensor) else t


def clip_grad_norm(
    params: list[torch.nn.Parameter],
    *,
    max_norm: float | None,
    tp_size: int | None = None,
    mesh: MeshContext | None = None,
) -> torch.Tensor:
    """Global L2 gradient norm of megatron-fsdp's distributed parameters, clipped to `max_norm`.

    Each gradient element lives on exactly one rank of the dp (dp_cp) group, and on every tp rank
    when its TP placement is Replicate; a rank may hold no element of a parameter (its ``.grad``
    is None there). So the norm is one all-reduce of per-rank sums of squares over the default
    group, tp-replicated sums divided by `tp_size` — the same number of collectives on every rank,
    whatever each one holds. `tp_size` defaults to `mesh`'s tp size (1 without a mesh). Returns
    the norm before clipping.
    """
    if tp_size is None:
        tp_size = 1 if mesh is None else mesh.layout.tp
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cuda", torch.cuda.current_device())
    sums = torch.zeros(2, dtype=torch.float32, device=device)  # [sharded, tp-replicated]
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        replicated_over_tp = (
            isinstance(g, DTensor)
            and "tp" in (g.device_mesh.mesh_dim_names or ())
            and isinstance(g.placements[g.device_mesh.mesh_dim_names.index("tp")], Replicate)
        )
        sums[1 if replicated_over_tp else 0] += local.float().pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(sums)
    norm = (sums[0] + sums[1] / tp_size).sqrt()
    if max_norm is not None:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(coef.to(local.dtype))
    return norm


def parameter_buffers(part: nn.Module) -> list[dict[str, Any]] | None:
    """megatron-fsdp's parameter groups of a wrapped part, each with its buffers (distributed or
    not, this rank's elements, the ranks it spans), for the layout report; None: not wrapped."""
    buffer = getattr(part, "param_and_grad_buffer", None)
    if buffer is None:
        return None
    groups = []
    for group in buffer.parameter_groups:
        entry: dict[str, Any] = {"num_params": len(group.params)}
        for kind in ("model_weight_buffer", "main_weight_buffer", "main_grad_buffer"):
            buf = getattr(group, kind, None)
            if buf is not None:
                entry[kind] = {
                    "distributed": bool(buf.is_data_distributed),
                    "local_numel": int(buf.data_size),
                    "dp_world_size": int(buf.dp_world_size),
                }
        groups.append(entry)
    return groups
