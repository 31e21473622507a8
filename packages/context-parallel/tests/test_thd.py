"""THD partition (pure torch) against an independent reference, and the TE-format batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from automodel.context_parallel import make_cp_batch_for_te, pad_documents, thd_partitioned_indices
from automodel.mesh import MeshContext, ParallelismSizes
from automodel.testing.ranks import run_on_ranks


def _reference_partition(doc_lengths: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """Written from the definition: each document in 2*cp equal chunks, keep r and 2cp-1-r."""
    out, start = [], 0
    for length in doc_lengths:
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
        start += length
    return out


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_thd_partition_matches_reference(cp_size):
    unit = 2 * cp_size
    doc_lengths = [unit * 3, unit, 0, unit * 5, unit * 2]  # includes an empty document
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(doc_lengths), 0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    seen = []
    for rank in range(cp_size):
        got = thd_partitioned_indices(cu, total, cp_size, rank)
        assert got.tolist() == _reference_partition(doc_lengths, cp_size, rank)
        seen.extend(got.tolist())
    assert sorted(seen) == list(range(total))  # the ranks partition the row


@pytest.mark.parametrize(
    ("cu", "total", "match"),
    [
        ([0, 6, 12], 12, "multiple of 2\\*cp_size"),
        ([0, 8, 16], 24, "must equal cu_seqlens_padded"),
        ([0, 8, 4], 8, "non-decreasing"),
    ],
)
def test_thd_partition_rejects_bad_input(cu, total, match):
    with pytest.raises(ValueError, match=match):
        thd_partitioned_indices(torch.tensor(cu), total, 2, 0)


def test_pad_documents_pads_each_document_to_the_multiple():
    ids = torch.arange(1, 11)
    out, cu, cu_p = pad_documents(
        {"input_ids": ids, "labels": ids + 100},
        cu_seqlens=torch.tensor([0, 3, 5, 9]),
        cu_seqlens_padded=torch.tensor([0, 3, 5, 9]),
        multiple=4,
        padding_token_id=0,
    )
    # Three documents (3, 2, 4 tokens) plus the trailing pack padding (1 token), each padded to 4.
    assert cu_p.tolist() == [0, 4, 8, 12, 16]
    assert cu.tolist() == [0, 3, 5, 9, 9]  # real lengths; the pack padding is a document without any
    assert out["input_ids"].tolist() == [1, 2, 3, 0, 4, 5, 0, 0, 6, 7, 8, 9, 10, 0, 0, 0]
    assert out["labels"].tolist()[:8] == [101, 102, 103, -100, 104, 105, -100, -100]


def _te_batches(num_chunks: int) -> dict:
    mesh = MeshContext.build(ParallelismSizes(cp_size=dist.get_world_size()))
    ids = torch.arange(1, 25).reshape(2, 12)
    batch = {
        "input_ids": ids,
        "labels": ids + 100,
        "position_ids": torch.tensor(
            [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
        ),
        "seq_lens": torch.tensor([[6, 5], [8, 4]]),
        "seq_lens_padded": torch.tensor([[6, 6], [8, 4]]),
    }
    out = make_cp_batch_for_te(mesh.get_mesh("cp"), batch, num_chunks=num_chunks)
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def test_make_cp_batch_for_te_shards_every_document_head_tail():
    r0, r1 = run_on_ranks(_te_batches, world_size=2, args=(1,), timeout_s=300)
    # Packed row of 4 documents (padded 6, 6, 8, 4) each re-padded to a multiple of 4: 8, 8, 8, 4.
    assert r0["cu_seqlens_padded"] == [0, 8, 16, 24, 28]
    assert r0["cu_seqlens"] == [0, 6, 11, 19, 23]
    assert r0["qkv_format"] == "thd" and r0["max_seqlen"] == 8 and (r0["cp_rank"], r1["cp_rank"]) == (0, 1)
    # Document 1 = tokens 1..6 then 2 pads: rank 0 keeps chunks 0 and 3 -> [1, 2] and [pad, pad].
    assert r0["input_ids"][:4] == [1, 2, 0, 0] and r1["input_ids"][:4] == [3, 4, 5, 6]
    assert sorted(r0["input_ids"] + r1["input_ids"]) == sorted([*range(1, 25), *[0] * 4])
    assert r0["padding_mask"][:4] == [False, False, True, True]


def test_make_cp_batch_for_te_stacks_chunks():
    r0, _ = run_on_ranks(_te_batches, world_size=2, args=(2,), timeout_s=300)
    assert len(r0["input_ids"]) == 2 and len(r0["cu_seqlens_padded"]) == 2
    assert r0["cu_seqlens_padded"][0] == [0, 8, 16] and r0["cu_seqlens_padded"][1] == [0, 8, 12]
    # Chunk 1 has 12 tokens (6 per rank), stacked under chunk 0's 16 (8 per rank): right-padded.
    assert r0["input_ids"][1][6:] == [0, 0] and r0["labels"][1][6:] == [-100, -100]
