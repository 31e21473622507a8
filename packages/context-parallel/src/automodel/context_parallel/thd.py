"""Packed sequences (THD): documents packed into one row, described by ``cu_seqlens``.

``cu_seqlens`` holds the cumulative real document lengths and ``cu_seqlens_padded`` the
cumulative lengths after each document was padded to a multiple of ``2 * cp``: under CP
every document is split into ``2 * cp`` chunks and rank r keeps chunks r and ``2*cp-1-r``
of each (Transformer Engine's layout). `thd_partitioned_indices` computes that partition in
pure torch so the THD path runs and is tested without Transformer Engine.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: Fill values for positions added by padding, per batch key (others get 0).
PAD_FILL: dict[str, int | bool] = {"labels": -100, "loss_mask": 0, "padding_mask": True}


def thd_partitioned_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Token indices (into the packed row) that CP rank `cp_rank` keeps, in local order.

    Same result as Transformer Engine's ``thd_get_partitioned_indices``: each document of
    padded length L contributes ``[r*L/2cp, (r+1)*L/2cp)`` then
    ``[(2cp-1-r)*L/2cp, (2cp-r)*L/2cp)`` of its own offsets, documents in order.
    """
    if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.numel() < 2:
        raise ValueError(
            f"cu_seqlens_padded must be 1-D with >= 2 entries, got shape {tuple(cu_seqlens_padded.shape)}"
        )
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need 0 <= cp_rank < cp_size, got cp_rank={cp_rank}, cp_size={cp_size}")
    cu = cu_seqlens_padded.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens_padded must start at 0 and be non-decreasing, got {cu.tolist()}")
    if bool((lengths % (2 * cp_size) != 0).any()):
        raise ValueError(
            f"every padded sequence length must be a multiple of 2*cp_size={2 * cp_size}, got {lengths.tolist()}"
        )
    if total_tokens % (2 * cp_size) != 0 or int(cu[-1]) != total_tokens:
        raise ValueError(
            f"total_tokens={total_tokens} must equal cu_seqlens_padded[-1]={int(cu[-1])} "
            f"and be a multiple of 2*cp_size={2 * cp_size}"
        )
    local_cu = cu // cp_size
    token = torch.arange(total_tokens // cp_size, device=cu.device)
    seq = (torch.searchsorted(local_cu, token, right=True) - 1).clamp(0, lengths.numel() - 1)
    half = (local_cu[seq + 1] - local_cu[seq]) // 2
    offset = token - local_cu[seq]
    head = offset < half
    chunk = torch.where(head, cp_rank, 2 * cp_size - 1 - cp_rank)
    return cu[seq] + chunk * half + torch.where(head, offset, offset - half)


def document_ids(cu_seqlens_padded: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """Which document (row of `cu_seqlens_padded`) each packed-row position belongs to."""
    return torch.searchsorted(cu_seqlens_padded.to(torch.int64), token_index, right=True) - 1


def cu_from_lengths(lengths: torch.Tensor, *, padding_value: int) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` (int32) from a lengths tensor, dropping `padding_value` entries."""
    flat = lengths.reshape(-1).cpu()  # metadata: index math stays on the CPU
    flat = flat[flat != padding_value].to(torch.int64)
    return torch.cat([flat.new_zeros(1), torch.cumsum(flat, 0)]).to(torch.int32)


def pad_documents(
    tensors: Mapping[str, torch.Tensor],
    *,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    multiple: int,
    padding_token_id: int,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Pad every document of a packed row so its length is a multiple of `multiple`.

    `tensors` are 1-D ``[T]`` (or ``[T, ...]``) packed rows. Tokens past ``cu_seqlens_padded[-1]``
    (pack-level padding) become one extra padding-only document. Returns the re-padded
    tensors and the new ``(cu_seqlens, cu_seqlens_padded)``; position ids keep counting inside
    a document, other keys get their `PAD_FILL` value (``input_ids``: `padding_token_id`).
    """
    total = next(iter(tensors.values())).shape[0]
    cu_p = cu_seqlens_padded.cpu().to(torch.int64)
    cu_r = cu_seqlens.cpu().to(torch.int64)
    if int(cu_p[-1]) > total:
        raise ValueError(f"cu_seqlens_padded[-1]={int(cu_p[-1])} exceeds the packed length {total}")
    if int(cu_p[-1]) < total:
        cu_p = torch.cat([cu_p, cu_p.new_tensor([total])])
        cu_r = torch.cat([cu_r, cu_r.new_tensor([int(cu_r[-1])])])
    lengths = cu_p[1:] - cu_p[:-1]
    new_lengths = (lengths + multiple - 1) // multiple * multiple
    new_cu_p = torch.cat([cu_p.new_zeros(1), torch.cumsum(new_lengths, 0)])
    # cu_seqlens stays the cumulative *real* lengths (TE reads offsets from cu_seqlens_padded).
    new_cu_r = torch.cat([cu_r.new_zeros(1), torch.cumsum((cu_r[1:] - cu_r[:-1]).clamp(min=0), 0)])
    if torch.equal(new_lengths, lengths):
        return dict(tensors), new_cu_r.to(torch.int32), new_cu_p.to(torch.int32)
    doc = document_ids(cu_p, torch.arange(total))
    dest = new_cu_p[doc] + (torch.arange(total) - cu_p[doc])
    new_total = int(new_cu_p[-1])
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if key == "position_ids":
            new_doc = document_ids(new_cu_p, torch.arange(new_total))
            filled = (torch.arange(new_total) - new_cu_p[new_doc]).to(t.dtype).to(t.device)
        else:
            fill = padding_token_id if key == "input_ids" else PAD_FILL.get(key, 0)
            filled = torch.full((new_total, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
        filled[dest.to(t.device)] = t
        out[key] = filled
    return out, new_cu_r.to(torch.int32), new_cu_p.to(torch.int32)
