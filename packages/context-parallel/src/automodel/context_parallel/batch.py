"""Per-step batch sharding for CP: `make_cp_batch_and_ctx`.

Every CP rank receives the same full batch; each keeps its load-balanced share of the
sequence. Because each CP rank sees the whole sequence, the global label count of the
micro-batch is known locally and is returned, so the loss ``sum(CE) / num_label_tokens``
summed over the CP group (and dp, and micro-batches) is exactly the single-process loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import SDPBackend, sdpa_kernel

from automodel.context_parallel.backends import BACKENDS, cp_submesh, resolve_backend
from automodel.context_parallel.layout import load_balanced_indices
from automodel.context_parallel.te_batch import make_cp_batch_for_te
from automodel.context_parallel.thd import PAD_FILL, cu_from_lengths, pad_documents, thd_partitioned_indices
from automodel.context_parallel.torch_internals import set_kv_rotation

IGNORE_INDEX = -100
_SEQ_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids", "loss_mask", "padding_mask")


def _count_label_tokens(labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    valid = labels != IGNORE_INDEX
    if loss_mask is not None:
        valid = valid & loss_mask.bool()
    return valid.sum().to(torch.int64)


def _is_packed(batch: dict[str, Any]) -> bool:
    return any(k in batch for k in ("seq_lens", "cu_seqlens"))


def _pad_to_multiple(t: torch.Tensor, key: str, multiple: int, padding_token_id: int) -> torch.Tensor:
    seq = t.shape[1]
    pad = (-seq) % multiple
    if pad == 0:
        return t
    if key == "position_ids":
        extra = torch.arange(seq, seq + pad, device=t.device, dtype=t.dtype).expand(t.shape[0], pad)
    else:
        fill = padding_token_id if key == "input_ids" else PAD_FILL.get(key, 0)
        extra = torch.full((t.shape[0], pad, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, extra], dim=1)


def _shard_bshd(batch: dict[str, Any], cp_size: int, cp_rank: int, padding_token_id: int) -> dict[str, Any]:
    input_ids = batch["input_ids"]
    bsz, seq = input_ids.shape[0], input_ids.shape[1]
    if seq < 2 * cp_size:
        raise ValueError(f"sequence length {seq} is shorter than 2*cp_size={2 * cp_size}: nothing to split")
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(seq, device=input_ids.device).unsqueeze(0)
    if batch["position_ids"].shape[0] != bsz:
        batch["position_ids"] = batch["position_ids"].expand(bsz, -1)
    padded_len = seq + (-seq) % (2 * cp_size)
    index = load_balanced_indices(padded_len, cp_size=cp_size, cp_rank=cp_rank, device=input_ids.device)
    for key in _SEQ_KEYS:
        if key in batch:
            t = _pad_to_multiple(batch[key], key, 2 * cp_size, padding_token_id)
            batch[key] = t.index_select(1, index).contiguous()
    return batch


def _shard_packed(
    batch: dict[str, Any], cp_size: int, cp_rank: int, padding_token_id: int, seq_lens_padding_value: int
) -> dict[str, Any]:
    input_ids = batch["input_ids"]
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"packed sequences need local_batch_size == 1 (one packed row per micro-batch), got batch size "
            f"{input_ids.shape[0]}"
        )
    if "cu_seqlens" in batch:
        cu = batch.pop("cu_seqlens").reshape(-1).cpu()
        cu_p = batch.pop("cu_seqlens_padded", cu).reshape(-1).cpu()
        cu, cu_p = cu[cu != seq_lens_padding_value], cu_p[cu_p != seq_lens_padding_value]
    else:
        cu = cu_from_lengths(batch.pop("seq_lens"), padding_value=seq_lens_padding_value)
        padded = batch.pop("seq_lens_padded", None)
        cu_p = cu.clone() if padded is None else cu_from_lengths(padded, padding_value=seq_lens_padding_value)
    tokens = {k: batch.pop(k)[0] for k in _SEQ_KEYS if k in batch}
    if "position_ids" not in tokens:
        # Positions restart in every document.
        doc = (
            torch.searchsorted(cu_p.to(torch.int64), torch.arange(input_ids.shape[1]), right=True) - 1
        ).clamp(max=cu_p.numel() - 2)
        tokens["position_ids"] = (torch.arange(input_ids.shape[1]) - cu_p.to(torch.int64)[doc]).to(
            input_ids.device
        )
    tokens, cu, cu_p = pad_documents(
        tokens, cu_seqlens=cu, cu_seqlens_padded=cu_p, multiple=2 * cp_size, padding_token_id=padding_token_id
    )
    total = tokens["input_ids"].shape[0]
    index = thd_partitioned_indices(cu_p, total, cp_size, cp_rank).to(input_ids.device)
    for key, t in tokens.items():
        batch[key] = t.index_select(0, index).unsqueeze(0).contiguous()
    lengths = (cu_p[1:] - cu_p[:-1]).to(torch.int64)
    batch["cu_seqlens"], batch["cu_seqlens_padded"] = cu.to(input_ids.device), cu_p.to(input_ids.device)
    batch["max_seqlen"] = int(lengths.max())
    return batch


def _torch_cp_context(cp_mesh: DeviceMesh, seq_len_global: int, kv_rotation: str) -> Callable[[], Any]:
    """torch's ``context_parallel()`` around the step: SDPA calls become ring attention.

    The batch is already sharded (same head-tail layout as torch's load balancer), so torch
    only gets a throw-away buffer to shard; what matters is its SDPA dispatch.
    """

    @contextlib.contextmanager
    def ctx():
        # lazy: start-up, torch's CP ~2.3 s, CUDA-only path
        from torch.distributed.tensor.experimental import context_parallel

        set_kv_rotation("alltoall" if kv_rotation == "p2p" else "allgather")
        dummy = torch.zeros(1, seq_len_global, device=cp_mesh.device_type)
        kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        with (
            sdpa_kernel(kernels),
            context_parallel(cp_mesh, buffers=[dummy], buffer_seq_dims=[1], no_restore_buffers={dummy}),
        ):
            yield

    return ctx


def make_cp_batch_and_ctx(
    cp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    use_te: bool = False,
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
    backend: str = "ring",
    kv_rotation: str = "allgather",
) -> tuple[Callable[[], Any], dict[str, Any]]:
    """Shard one micro-batch for CP; return ``(ctx, local_batch)``, used as ``with ctx(): ...``.

    Reads ``input_ids`` and ``labels`` ``[B, S]`` (required), ``position_ids`` (default
    ``arange``), ``padding_mask``, `loss_mask`; drops ``attention_mask`` (CP attention is causal
    by construction). Packed rows (``seq_lens``/``seq_lens_padded`` or ``cu_seqlens``/
    ``cu_seqlens_padded`` present) need B == 1. Sequences are padded to a multiple of
    ``2 * cp`` (labels -100, loss_mask 0) and rank r keeps chunks r and ``2*cp-1-r``; packed
    rows are split per document the same way. The local batch adds ``num_label_tokens``: the
    number of label tokens of the whole (unsharded) micro-batch, identical on every CP rank.
    `backend`/`kv_rotation` must be what `apply_context_parallel` resolved ("none" = no CP); `use_te` returns
    the Transformer Engine THD format of `make_cp_batch_for_te` instead.
    """
    if backend not in (*BACKENDS, "none"):
        raise ValueError(f"backend must be one of {(*BACKENDS, 'none')}, got {backend!r}")
    cp_mesh = cp_submesh(cp_mesh)
    batch = dict(batch)
    if "input_ids" not in batch or "labels" not in batch:
        raise ValueError(
            f"make_cp_batch_and_ctx needs 'input_ids' and 'labels' in the batch, got {sorted(batch)}"
        )
    if loss_mask is not None:
        if loss_mask.shape != batch["labels"].shape:
            raise ValueError(
                f"loss_mask shape {tuple(loss_mask.shape)} != labels shape {tuple(batch['labels'].shape)}"
            )
        batch["loss_mask"] = loss_mask
    batch.pop("attention_mask", None)
    num_label_tokens = _count_label_tokens(batch["labels"], batch.get("loss_mask"))
    cp_size = 1 if cp_mesh is None else cp_mesh.size()
    if use_te:
        local = make_cp_batch_for_te(
            cp_mesh if cp_size > 1 else None,
            batch,
            padding_token_id=padding_token_id,
            num_chunks=num_chunks,
            seq_lens_padding_value=seq_lens_padding_value,
        )
        local["num_label_tokens"] = num_label_tokens
        return contextlib.nullcontext, local
    if cp_size == 1:
        batch["num_label_tokens"] = num_label_tokens
        return contextlib.nullcontext, batch
    if backend == "none":
        raise ValueError(
            f"backend='none' (what apply_context_parallel returns without CP) but the CP mesh has {cp_size} ranks"
        )
    backend = resolve_backend(backend, device_type=cp_mesh.device_type)
    cp_rank = cp_mesh.get_local_rank()
    if _is_packed(batch):
        local = _shard_packed(batch, cp_size, cp_rank, padding_token_id, seq_lens_padding_value)
        # Packed rows go through the ring kernel (document masks) or TE, never torch's SDPA ring.
        ctx: Callable[[], Any] = contextlib.nullcontext
    else:
        seq = batch["input_ids"].shape[1]
        local = _shard_bshd(batch, cp_size, cp_rank, padding_token_id)
        ctx = contextlib.nullcontext
        if backend == "torch":
            ctx = _torch_cp_context(cp_mesh, seq + (-seq) % (2 * cp_size), kv_rotation)
    local["num_label_tokens"] = num_label_tokens
    return ctx, local
