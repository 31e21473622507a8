"""Batches for Transformer Engine models in THD format (1-D packed rows), sharded for CP.

The output follows the reference layer: 1-D ``input_ids`` / ``labels`` / ``position_ids`` /
``padding_mask`` of this rank's tokens, the global ``cu_seqlens`` / ``cu_seqlens_padded``
(int32), ``max_seqlen``, ``qkv_format="thd"``, ``cp_size`` and ``cp_rank``. The partition is
`thd_partitioned_indices` (pure torch, identical to TE's ``thd_get_partitioned_indices``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from automodel.context_parallel.thd import PAD_FILL, cu_from_lengths, pad_documents, thd_partitioned_indices

_TOKEN_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids", "loss_mask", "padding_mask")


def _to_thd(batch: dict[str, Any], *, seq_lens_padding_value: int, padding_token_id: int) -> dict[str, Any]:
    """Flatten ``[B, S]`` rows into one packed row and build ``cu_seqlens`` / ``cu_seqlens_padded``."""
    for key in ("input_ids", "labels"):
        if key not in batch:
            raise ValueError(f"THD batches need {key!r}; got keys {sorted(batch)}")
    input_ids = batch["input_ids"]
    bsz, seq = input_ids.shape[0], input_ids.shape[1]
    out: dict[str, Any] = {}
    for key in _TOKEN_KEYS:
        if key in batch and isinstance(batch[key], torch.Tensor):
            t = batch[key]
            out[key] = t.reshape(bsz * seq, *t.shape[2:])
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"].reshape(-1).cpu()
        cu = cu[cu != seq_lens_padding_value].to(torch.int32)
        cu_p = batch.get("cu_seqlens_padded", cu).reshape(-1).cpu()
        cu_p = cu_p[cu_p != seq_lens_padding_value].to(torch.int32)
    elif "seq_lens" in batch:
        cu = cu_from_lengths(batch["seq_lens"], padding_value=seq_lens_padding_value)
        cu_p = cu_from_lengths(
            batch.get("seq_lens_padded", batch["seq_lens"]), padding_value=seq_lens_padding_value
        )
    else:
        # Plain rows: every row is one document.
        cu = torch.arange(0, bsz * seq + 1, seq, dtype=torch.int32)
        cu_p = cu.clone()
    if cu.numel() != cu_p.numel():
        raise ValueError(f"cu_seqlens ({cu.numel()} entries) and cu_seqlens_padded ({cu_p.numel()}) disagree")
    if "position_ids" not in out:
        doc = torch.searchsorted(cu_p.to(torch.int64), torch.arange(bsz * seq), right=True) - 1
        doc = doc.clamp(max=cu_p.numel() - 2)
        out["position_ids"] = (torch.arange(bsz * seq) - cu_p.to(torch.int64)[doc]).to(input_ids.device)
    out["cu_seqlens"], out["cu_seqlens_padded"] = cu.to(input_ids.device), cu_p.to(input_ids.device)
    return out


def _finish(thd: dict[str, Any], *, cp_size: int, cp_rank: int, padding_token_id: int) -> dict[str, Any]:
    """Add the keys a TE model reads besides the tokens (max_seqlen, qkv_format, cp rank/size)."""
    cu_p = thd["cu_seqlens_padded"]
    lengths = (cu_p[1:] - cu_p[:-1]).to(torch.int64)
    thd["max_seqlen"] = int(lengths.max()) if lengths.numel() else 0
    thd["qkv_format"] = "thd"
    thd["padding_mask"] = thd.get("padding_mask", thd["input_ids"] == padding_token_id)
    thd["cp_size"], thd["cp_rank"] = cp_size, cp_rank
    for key in ("input_ids", "labels", "position_ids"):
        if not thd[key].is_floating_point():  # input_ids may be embeddings under PP
            thd[key] = thd[key].to(torch.int64)
        thd[key] = thd[key].contiguous()
    return thd


def _shard_thd_chunk_for_te(
    batch: dict[str, Any],
    cp_mesh: DeviceMesh,
    qkv_format: str,
    seq_lens_padding_value: int,
    padding_token_id: int,
) -> dict[str, Any]:
    """Shard one THD chunk (1-D packed row + global cu_seqlens) to this CP rank.

    Documents are first padded to multiples of ``2 * cp`` (a no-op when the packer already
    did), then every token tensor keeps `thd_partitioned_indices` of its positions.
    """
    if qkv_format != "thd":
        raise ValueError(f"qkv_format must be 'thd', got {qkv_format!r}")
    if "cu_seqlens" not in batch:
        raise ValueError("THD sharding needs 'cu_seqlens' (and optionally 'cu_seqlens_padded') in the batch")
    cp_size, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    cu = batch["cu_seqlens"].cpu()
    cu = cu[cu != seq_lens_padding_value]
    cu_p = batch.get("cu_seqlens_padded", batch["cu_seqlens"]).cpu()
    cu_p = cu_p[cu_p != seq_lens_padding_value]
    tokens = {k: batch[k] for k in _TOKEN_KEYS if k in batch}
    tokens, cu, cu_p = pad_documents(
        tokens, cu_seqlens=cu, cu_seqlens_padded=cu_p, multiple=2 * cp_size, padding_token_id=padding_token_id
    )
    total = next(iter(tokens.values())).shape[0]
    index = thd_partitioned_indices(cu_p, total, cp_size, cp_rank)
    out: dict[str, Any] = {k: v.index_select(0, index.to(v.device)) for k, v in tokens.items()}
    device = out["input_ids"].device
    out["cu_seqlens"], out["cu_seqlens_padded"] = cu.to(device), cu_p.to(device)
    return _finish(out, cp_size=cp_size, cp_rank=cp_rank, padding_token_id=padding_token_id)


def make_cp_batch_for_te(
    cp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    *,
    qkv_format: str = "thd",
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
) -> dict[str, Any]:
    """Convert a ``[B, S]`` (packed) batch to THD and shard it for a TE model with CP.

    With ``num_chunks > 1`` the B rows are split into `num_chunks` groups, each becomes one
    packed row, and the per-chunk results are stacked (``[num_chunks, tokens]``; cu_seqlens
    right-padded with `seq_lens_padding_value`).
    """
    if qkv_format != "thd":
        raise ValueError(f"qkv_format must be 'thd', got {qkv_format!r}")
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    bsz = batch["input_ids"].shape[0]
    if bsz % num_chunks != 0:
        raise ValueError(f"num_chunks={num_chunks} must divide the batch size {bsz}")
    cp_size = 1 if cp_mesh is None else cp_mesh.size()
    rows = bsz // num_chunks
    chunks = []
    for c in range(num_chunks):
        part = {
            k: (v[c * rows : (c + 1) * rows] if isinstance(v, torch.Tensor) and v.dim() >= 1 else v)
            for k, v in batch.items()
        }
        thd = _to_thd(part, seq_lens_padding_value=seq_lens_padding_value, padding_token_id=padding_token_id)
        if cp_size > 1:
            chunks.append(
                _shard_thd_chunk_for_te(thd, cp_mesh, qkv_format, seq_lens_padding_value, padding_token_id)
            )
        else:
            chunks.append(_finish(thd, cp_size=1, cp_rank=0, padding_token_id=padding_token_id))
    if num_chunks == 1:
        return chunks[0]
    return _stack_chunks(chunks, padding_value=seq_lens_padding_value, padding_token_id=padding_token_id)


def _stack_chunks(
    chunks: list[dict[str, Any]], *, padding_value: int, padding_token_id: int
) -> dict[str, Any]:
    """Stack per-chunk results; shorter chunks are right-padded (tokens past their last document)."""
    out: dict[str, Any] = dict(chunks[0])
    for key, first in chunks[0].items():
        if not isinstance(first, torch.Tensor):
            continue
        width = max(c[key].shape[0] for c in chunks)
        if key in ("cu_seqlens", "cu_seqlens_padded"):
            fill = padding_value
        else:
            fill = padding_token_id if key == "input_ids" else PAD_FILL.get(key, 0)
        padded = []
        for c in chunks:
            t = c[key]
            extra = torch.full((width - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            padded.append(torch.cat([t, extra]))
        out[key] = torch.stack(padded)
    out["max_seqlen"] = torch.tensor([c["max_seqlen"] for c in chunks], dtype=torch.int32)
    return out
