"""make_cp_batch_and_ctx: head-tail layout, padding, global label counts, torch-compatible layout."""

from __future__ import annotations

import torch
import torch.distributed as dist

from automodel.context_parallel import make_cp_batch_and_ctx, unshard_sequence
from automodel.mesh import MeshContext, ParallelismSizes
from automodel.testing.ranks import run_on_ranks


def _shard_and_gather() -> dict:
    world = dist.get_world_size()
    mesh = MeshContext.build(ParallelismSizes(cp_size=world))
    cp_mesh = mesh.get_mesh("cp")
    ids = torch.arange(1, 2 * 11 + 1).reshape(2, 11)  # odd length: padded to 12 (cp=2) / 16 (cp=4)
    labels = ids + 1000
    labels[1, 4:] = -100
    loss_mask = torch.ones_like(ids)
    loss_mask[0, 0] = 0
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    ctx, local = make_cp_batch_and_ctx(cp_mesh, batch, loss_mask=loss_mask, padding_token_id=0)
    assert ctx is not None and "attention_mask" not in local
    group = cp_mesh.get_group()
    return {
        "local_input_ids": local["input_ids"].tolist(),
        "input_ids": unshard_sequence(local["input_ids"], dim=1, group=group).tolist(),
        "labels": unshard_sequence(local["labels"], dim=1, group=group).tolist(),
        "position_ids": unshard_sequence(local["position_ids"], dim=1, group=group).tolist(),
        "loss_mask": unshard_sequence(local["loss_mask"], dim=1, group=group).tolist(),
        "num_label_tokens": int(local["num_label_tokens"]),
    }


def test_bshd_sharding_is_head_tail_and_padded():
    for world, padded in ((2, 12), (4, 16)):
        results = run_on_ranks(_shard_and_gather, world_size=world, timeout_s=300)
        pad = padded - 11
        for r in results:
            assert r["input_ids"][0] == list(range(1, 12)) + [0] * pad
            assert r["labels"][0] == list(range(1001, 1012)) + [-100] * pad
            assert r["position_ids"][1] == list(range(padded))
            assert r["loss_mask"][0] == [0] + [1] * 10 + [0] * pad
            # 11 labels in row 0 minus the masked first, 4 in row 1: same count on every rank
            assert r["num_label_tokens"] == 10 + 4
        chunk = padded // (2 * world)
        # rank 0 keeps chunk 0 and chunk 2*cp-1 of the padded row
        row = list(range(1, 12)) + [0] * pad
        assert results[0]["local_input_ids"][0] == row[:chunk] + row[-chunk:]


def _torch_layout() -> list[list[int]]:
    """The layout torch's own context_parallel() gives a buffer (its head-tail load balancer)."""
    from torch.distributed.tensor.experimental import context_parallel

    world = dist.get_world_size()
    mesh = MeshContext.build(ParallelismSizes(cp_size=world))
    cp_mesh = mesh.get_mesh("cp")
    theirs = torch.arange(16).unsqueeze(0)
    with context_parallel(cp_mesh, buffers=[theirs], buffer_seq_dims=[1], no_restore_buffers={theirs}):
        pass
    # The whole device mesh works too: its "cp" dim is used.
    _, local = make_cp_batch_and_ctx(
        mesh.device_mesh, {"input_ids": torch.arange(16).unsqueeze(0), "labels": torch.zeros(1, 16)}
    )
    return [theirs[0].tolist(), local["input_ids"][0].tolist()]


def test_layout_matches_torch_context_parallel():
    # So a batch sharded here feeds torch's SDPA ring (backend="torch") unchanged.
    for theirs, ours in run_on_ranks(_torch_layout, world_size=2, timeout_s=300):
        assert theirs == ours


def test_no_cp_returns_the_batch_with_the_label_count():
    ids = torch.arange(8).unsqueeze(0)
    ctx, local = make_cp_batch_and_ctx(
        None, {"input_ids": ids, "labels": torch.tensor([[1, 2, -100, 4, 5, 6, 7, -100]])}
    )
    assert torch.equal(local["input_ids"], ids) and int(local["num_label_tokens"]) == 6
    with ctx():
        pass
