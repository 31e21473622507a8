"""Ring attention alone: output and q/k/v gradients equal full attention on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from automodel.context_parallel import contiguous_indices, load_balanced_indices, ring_attention
from automodel.testing.ranks import run_on_ranks

B, HQ, HKV, D = 2, 4, 2, 8


def _reference(q, k, v, mask):
    """Plain-math attention written independently of the package (GQA by repeating K/V)."""
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = q @ k.transpose(-1, -2) * D**-0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _ring_vs_full(seq_len: int, padded_len: int, docs: list[int] | None) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    q = torch.randn(B, HQ, seq_len, D, dtype=torch.float64)
    k = torch.randn(B, HKV, seq_len, D, dtype=torch.float64)
    v = torch.randn(B, HKV, seq_len, D, dtype=torch.float64)
    grad = torch.randn(B, HQ, seq_len, D, dtype=torch.float64)
    pos = torch.arange(seq_len)
    doc = None if docs is None else torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    mask = pos[None, :] <= pos[:, None]
    if doc is not None:
        mask &= doc[:, None] == doc[None, :]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(full[0], full[1], full[2], mask)
    ref.backward(grad)
    pad = padded_len - seq_len

    def padded(t):
        return F.pad(t, (0, 0, 0, pad))

    errors = {}
    for balanced in (True, False):
        make = load_balanced_indices if balanced else contiguous_indices
        index = make(padded_len, cp_size=world, cp_rank=rank)
        doc_local = None
        if doc is not None:
            doc_local = torch.cat([doc, torch.full((pad,), len(docs))])[index]
        for rotation in ("allgather", "p2p"):
            local = [padded(t).index_select(2, index).float().requires_grad_() for t in (q, k, v)]
            out = ring_attention(
                *local, cp_group=dist.group.WORLD, token_index=index, doc_ids=doc_local, kv_rotation=rotation
            )
            out.backward(padded(grad).index_select(2, index).float())
            real = index < seq_len
            err = (out[:, :, real] - ref[:, :, index[real]]).abs().max()
            for mine, theirs in zip(local, full):
                err = max(err, (mine.grad[:, :, real] - theirs.grad[:, :, index[real]]).abs().max())
            errors[f"balanced={balanced} rotation={rotation}"] = float(err.detach())
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_full_attention(world):
    # Odd length 13 padded to 16 = multiple of 2*cp; pad tokens come last and never reach real queries.
    results = run_on_ranks(_ring_vs_full, world_size=world, args=(13, 16, None), timeout_s=300)
    for rank_errors in results:
        assert len(rank_errors) == 4
        for case, err in rank_errors.items():
            assert err < 1e-5, f"{case}: max abs error {err}"


def test_ring_attention_document_masks():
    results = run_on_ranks(_ring_vs_full, world_size=2, args=(16, 16, [5, 8, 3]), timeout_s=300)
    for rank_errors in results:
        for case, err in rank_errors.items():
            assert err < 1e-5, f"{case}: max abs error {err}"


def _bad_rotation():
    q = torch.zeros(1, 2, 4, 8)
    ring_attention(q, q, q, cp_group=dist.group.WORLD, token_index=torch.arange(4), kv_rotation="ring")


def test_bad_kv_rotation_is_a_value_error():
    with pytest.raises(Exception, match="kv_rotation must be one of"):
        run_on_ranks(_bad_rotation, world_size=1, timeout_s=120)
