"""Tiny HF Llama under CP: loss and gradients equal a single-process run (fp32, 1e-5).

Layouts: cp=2, cp=4, cp=2 x FSDP2 dp=2 (fully_shard over dp_shard_cp), cp=2 x TP=2, and a
packed row (THD) against running every document separately.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from automodel.context_parallel import apply_context_parallel, make_cp_batch_and_ctx
from automodel.mesh import MeshContext, ParallelismSizes
from automodel.mesh.reduction import set_unit_gradient_divide_factor
from automodel.testing.ranks import run_on_ranks
from automodel.testing.tiny_model import tiny_causal_lm, tiny_llama

sys.path.insert(0, str(Path(__file__).parent))
from cp_testlib import VOCAB, ce_sum  # noqa: E402

RTOL = 1e-5


def _batch(seed: int, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch_size, seq_len), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((batch_size, 1), -100)], dim=1)
    labels[0, :3] = -100  # some ignored labels, so the global count matters
    return {"input_ids": ids, "labels": labels}


def _reference(model, batches) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss = sum CE over all batches / all label tokens, and its gradients."""
    model.zero_grad()
    total = sum(int((b["labels"] != -100).sum()) for b in batches)
    loss = (
        torch.stack([ce_sum(model(input_ids=b["input_ids"]).logits, b["labels"]) for b in batches]).sum()
        / total
    )
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _full_grad(p: torch.nn.Parameter) -> torch.Tensor:
    g = p.grad
    assert g is not None, "no gradient"
    return g.full_tensor() if isinstance(g, DTensor) else g


def _compare(loss: float, grads: dict[str, torch.Tensor], ref_loss: float, ref_grads) -> dict[str, float]:
    errs = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    for name, ref in ref_grads.items():
        errs[name] = float((grads[name] - ref).norm() / ref.norm().clamp(min=1e-12))
    return errs


def _cp_step(model, batch, cp_mesh, backend, reduce_group, num_tokens_group=None):
    """One CP forward/backward with the recipe's loss: sum CE / global label tokens."""
    ctx, local = make_cp_batch_and_ctx(cp_mesh, batch, backend=backend)
    labels = local.pop("labels")
    num_tokens = local.pop("num_label_tokens").clone()
    if num_tokens_group is not None:
        dist.all_reduce(num_tokens, group=num_tokens_group)
    with ctx():
        logits = model(**local, use_cache=False).logits  # no KV cache in training (AC recomputes)
        loss = ce_sum(logits, labels) / num_tokens
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=reduce_group)
    return float(total)


def _run_cp_only(
    seq_len: int, kv_rotation: str, family: str = "llama", checkpointing: bool = False
) -> dict[str, float]:
    world = dist.get_world_size()
    mesh = MeshContext.build(ParallelismSizes(cp_size=world))
    ref_model = tiny_causal_lm(family)
    model = copy.deepcopy(ref_model)
    batch = _batch(1, 2, seq_len)
    ref_loss, ref_grads = _reference(ref_model, [batch])
    cp_mesh = mesh.get_mesh("cp")
    backend = apply_context_parallel(model, cp_mesh=cp_mesh, backend="ring", kv_rotation=kv_rotation)
    if checkpointing:  # AC comes after the CP hooks; recomputation re-runs the ring
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = checkpoint_wrapper(layer)
    loss = _cp_step(model, batch, cp_mesh, backend, cp_mesh.get_group())
    for p in model.parameters():  # what FSDP/DDP over dp_shard_cp would do: sum over the CP ranks
        dist.all_reduce(p.grad, group=cp_mesh.get_group())
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
    return _compare(loss, grads, ref_loss, ref_grads)


def _assert_close(results):
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v < RTOL}
        assert not bad, f"rank {rank}: relative errors above {RTOL}: {bad}"


@pytest.mark.parametrize(("world", "seq_len", "kv_rotation"), [(2, 30, "allgather"), (4, 32, "p2p")])
def test_llama_cp_matches_single_process(world, seq_len, kv_rotation):
    # seq 30 is padded to 32 by make_cp_batch_and_ctx (labels -100 on the padding).
    _assert_close(run_on_ranks(_run_cp_only, world_size=world, args=(seq_len, kv_rotation), timeout_s=300))


def test_qwen3_cp_with_activation_checkpointing_matches_single_process():
    # Another HF family unchanged (q/k norms, head_dim != hidden/heads) and AC recomputation.
    results = run_on_ranks(_run_cp_only, world_size=2, args=(24, "p2p", "qwen3", True), timeout_s=300)
    _assert_close(results)


def _run_cp_fsdp() -> dict[str, float]:
    from torch.distributed.fsdp import fully_shard

    mesh = MeshContext.build(ParallelismSizes(cp_size=2))
    ref_model = tiny_llama()
    model = copy.deepcopy(ref_model)
    batches = [_batch(10 + d, 2, 24) for d in range(mesh.layout.dp)]
    ref_loss, ref_grads = _reference(ref_model, batches)
    cp_mesh = mesh.get_mesh("cp")
    backend = apply_context_parallel(model, cp_mesh=cp_mesh, backend="ring", kv_rotation="p2p")
    fsdp_mesh = mesh.get_mesh("dp_shard_cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    for unit in [*model.model.layers, model]:
        # pure sum: the loss is already globally normalised
        set_unit_gradient_divide_factor(unit, factor=1.0)
    dp_rank = mesh.coordinates["dp_shard"]
    loss = _cp_step(
        model,
        batches[dp_rank],
        cp_mesh,
        backend,
        mesh.get_mesh("dp_cp").get_group(),
        mesh.get_mesh("dp").get_group(),
    )
    return _compare(loss, {n: _full_grad(p) for n, p in model.named_parameters()}, ref_loss, ref_grads)


def test_llama_cp2_fsdp2_dp2_matches_single_process():
    _assert_close(run_on_ranks(_run_cp_fsdp, world_size=4, timeout_s=300))


def _run_cp_tp() -> dict[str, float]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = MeshContext.build(ParallelismSizes(cp_size=2, tp_size=2))
    ref_model = tiny_llama()
    model = copy.deepcopy(ref_model)
    batch = _batch(3, 2, 24)
    ref_loss, ref_grads = _reference(ref_model, [batch])
    tp_mesh = mesh.get_mesh("tp")
    plan = {}
    for i in range(len(model.model.layers)):
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{proj}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    cp_mesh = mesh.get_mesh("cp")
    backend = apply_context_parallel(model, cp_mesh=cp_mesh, backend="ring")
    loss = _cp_step(model, batch, cp_mesh, backend, cp_mesh.get_group())
    grads = {}
    for name, p in model.named_parameters():
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(local, group=cp_mesh.get_group())
        grads[name] = _full_grad(p)
    return _compare(loss, grads, ref_loss, ref_grads)


def test_llama_cp2_tp2_matches_single_process():
    _assert_close(run_on_ranks(_run_cp_tp, world_size=4, timeout_s=300))


DOCS = [7, 12, 9]  # 28 real tokens in one packed row, plus 2 tokens of pack padding


def _packed_batch() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(1, VOCAB, (1, n), generator=g) for n in DOCS]
    per_doc = [
        {"input_ids": d, "labels": torch.cat([d[:, 1:], torch.full((1, 1), -100)], dim=1)} for d in docs
    ]
    ids = torch.cat([d["input_ids"] for d in per_doc] + [torch.zeros(1, 2, dtype=torch.long)], dim=1)
    labels = torch.cat([d["labels"] for d in per_doc] + [torch.full((1, 2), -100)], dim=1)
    packed = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.cat([torch.arange(n) for n in DOCS] + [torch.arange(2)]).unsqueeze(0),
        "seq_lens": torch.tensor([DOCS + [-1000]]),
        "seq_lens_padded": torch.tensor([[7, 12, 11, -1000]]),
    }
    return packed, per_doc


def _run_packed(kv_rotation: str) -> dict[str, float]:
    world = dist.get_world_size()
    mesh = MeshContext.build(ParallelismSizes(cp_size=world))
    ref_model = tiny_llama()
    model = copy.deepcopy(ref_model)
    packed, per_doc = _packed_batch()
    ref_loss, ref_grads = _reference(ref_model, per_doc)  # every document run on its own
    cp_mesh = mesh.get_mesh("cp")
    backend = apply_context_parallel(model, cp_mesh=cp_mesh, backend="ring", kv_rotation=kv_rotation)
    loss = _cp_step(model, packed, cp_mesh, backend, cp_mesh.get_group())
    for p in model.parameters():
        dist.all_reduce(p.grad, group=cp_mesh.get_group())
    return _compare(loss, {n: p.grad for n, p in model.named_parameters()}, ref_loss, ref_grads)


@pytest.mark.parametrize(("world", "kv_rotation"), [(2, "p2p"), (4, "allgather")])
def test_packed_sequences_equal_per_document_runs(world, kv_rotation):
    _assert_close(run_on_ranks(_run_packed, world_size=world, args=(kv_rotation,), timeout_s=300))
