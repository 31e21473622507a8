"""CUDA-only parity: torch's context_parallel() SDPA path and the Transformer Engine path.

Run by ``nox -s gpu_tests``; skipped (with the reason) on machines without CUDA. The torch
and TE paths need two GPUs (one CP rank each, NCCL); TE must be installed (the ``[te]`` extra).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from automodel.context_parallel import apply_context_parallel, make_cp_batch_and_ctx, thd_partitioned_indices
from automodel.mesh.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from cp_testlib import VOCAB, ce_sum, tiny_llama  # noqa: E402

pytestmark = pytest.mark.gpu


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices, found {torch.cuda.device_count()}")


def _cuda_cp_mesh():
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    group = dist.new_group(backend="nccl")
    return DeviceMesh.from_group(group, "cuda", mesh_dim_names=("cp",))


def _rel_errors(model, ref_model, loss, ref_loss, group) -> dict[str, float]:
    errs = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    for (name, p), (_, r) in zip(model.named_parameters(), ref_model.named_parameters()):
        dist.all_reduce(p.grad, group=group)
        errs[name] = float((p.grad.float() - r.grad.float()).norm() / r.grad.float().norm().clamp(min=1e-12))
    return errs


def _cp_step_errors(model, ref_model, ref_loss, cp_mesh, batch: dict, backend: str) -> dict[str, float]:
    """One CP forward/backward of `batch`; relative loss and per-parameter gradient errors vs the reference."""
    ctx, local = make_cp_batch_and_ctx(cp_mesh, batch, backend=backend)
    local_labels, n = local.pop("labels"), local.pop("num_label_tokens")
    with ctx():
        loss = ce_sum(model(**local).logits, local_labels) / n
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_mesh.get_group())
    return _rel_errors(model, ref_model, float(total), float(ref_loss), cp_mesh.get_group())


def _torch_backend_parity() -> dict[str, float]:
    cp_mesh = _cuda_cp_mesh()
    ref_model = tiny_llama().to(device="cuda", dtype=torch.float32)
    model = copy.deepcopy(ref_model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 64), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    ref_loss = ce_sum(ref_model(input_ids=ids.cuda()).logits, labels.cuda()) / (labels != -100).sum().cuda()
    ref_loss.backward()
    backend = apply_context_parallel(model, cp_mesh=cp_mesh, backend="torch")
    assert backend == "torch"
    batch = {"input_ids": ids.cuda(), "labels": labels.cuda()}
    return _cp_step_errors(model, ref_model, ref_loss, cp_mesh, batch, backend)


def test_torch_context_parallel_backend_matches_single_gpu():
    _need_gpus(2)
    for rank, errs in enumerate(run_on_ranks(_torch_backend_parity, world_size=2, timeout_s=600)):
        bad = {k: v for k, v in errs.items() if not v < 1e-4}
        assert not bad, f"rank {rank}: {bad}"


def test_thd_partition_matches_transformer_engine():
    tex = pytest.importorskip("transformer_engine_torch")
    for cp_size in (1, 2, 4):
        unit = 2 * cp_size
        cu = torch.tensor([0, 3 * unit, 4 * unit, 4 * unit, 9 * unit], dtype=torch.int32)
        total = int(cu[-1])
        for rank in range(cp_size):
            theirs = tex.thd_get_partitioned_indices(cu.cuda(), total, cp_size, rank)
            ours = thd_partitioned_indices(cu.cuda(), total, cp_size, rank)
            assert theirs.tolist() == ours.tolist(), (cp_size, rank)


def _te_packed_parity() -> dict[str, float]:
    cp_mesh = _cuda_cp_mesh()
    ref_model = tiny_llama().to(device="cuda", dtype=torch.bfloat16)
    model = copy.deepcopy(ref_model)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(1, VOCAB, (1, n), generator=g) for n in (24, 40, 16)]
    per_doc = [(d, torch.cat([d[:, 1:], torch.full((1, 1), -100)], dim=1)) for d in docs]
    n_ref = sum(int((lab != -100).sum()) for _, lab in per_doc)
    ref_loss = sum(ce_sum(ref_model(input_ids=d.cuda()).logits, lab.cuda()) for d, lab in per_doc) / n_ref
    ref_loss.backward()
    backend = apply_context_parallel(model, cp_mesh=cp_mesh, backend="te")
    packed = {
        "input_ids": torch.cat([d for d, _ in per_doc], dim=1).cuda(),
        "labels": torch.cat([lab for _, lab in per_doc], dim=1).cuda(),
        "seq_lens": torch.tensor([[24, 40, 16]]).cuda(),
    }
    return _cp_step_errors(model, ref_model, ref_loss, cp_mesh, packed, backend)


def test_transformer_engine_backend_packed_matches_per_document():
    pytest.importorskip("transformer_engine.pytorch")
    _need_gpus(2)
    for rank, errs in enumerate(run_on_ranks(_te_packed_parity, world_size=2, timeout_s=600)):
        bad = {k: v for k, v in errs.items() if not v < 3e-2}  # bf16 tolerance
        assert not bad, f"rank {rank}: {bad}"
