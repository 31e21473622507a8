"""torchrun worker for test_gpu.py: one CP forward/backward on CUDA vs the single-GPU reference.

Run: ``torchrun --standalone --nproc_per_node=N gpu_cp_worker.py --backend torch --out errors.json``.
Every rank holds the full reference model (same seed); the CP copy of it runs over all N ranks
(NCCL, one GPU per rank). Rank 0 writes each rank's relative loss and per-parameter gradient
errors (CP gradients summed over the CP group) and the backend `apply_context_parallel` resolved.
With N == 1 there is no CP (backend "none"): the batch and model pass through unchanged.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from automodel.context_parallel import apply_context_parallel, make_cp_batch_and_ctx
from automodel.testing.tiny_model import tiny_llama

sys.path.insert(0, str(Path(__file__).parent))
from cp_testlib import VOCAB, ce_sum  # noqa: E402


def _rel_errors(model, ref_model, loss: float, ref_loss: float, group) -> dict[str, float]:
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


def torch_backend_parity(cp_mesh) -> tuple[str, dict[str, float]]:
    """torch's context_parallel() SDPA path (fp32, one [2, 64] batch)."""
    ref_model = tiny_llama().to(device="cuda", dtype=torch.float32)  # pyright: ignore[reportCallIssue]  # @wraps'd HF method (typeshed)
    model = copy.deepcopy(ref_model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 64), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    ref_loss = ce_sum(ref_model(input_ids=ids.cuda()).logits, labels.cuda()) / (labels != -100).sum().cuda()
    ref_loss.backward()
    backend = apply_context_parallel(model, cp_mesh=cp_mesh, backend="torch")
    batch = {"input_ids": ids.cuda(), "labels": labels.cuda()}
    return backend, _cp_step_errors(model, ref_model, ref_loss, cp_mesh, batch, backend)


def te_packed_parity(cp_mesh) -> tuple[str, dict[str, float]]:
    """Transformer Engine THD path: three packed documents vs each document alone (bf16)."""
    ref_model = tiny_llama().to(device="cuda", dtype=torch.bfloat16)  # pyright: ignore[reportCallIssue]  # @wraps'd HF method (typeshed)
    model = copy.deepcopy(ref_model)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(1, VOCAB, (1, n), generator=g) for n in (24, 40, 16)]
    per_doc = [(d, torch.cat([d[:, 1:], torch.full((1, 1), -100)], dim=1)) for d in docs]
    n_ref = sum(int((lab != -100).sum()) for _, lab in per_doc)
    ref_loss = torch.stack(
        [ce_sum(ref_model(input_ids=d.cuda()).logits, lab.cuda()) for d, lab in per_doc]
    ).sum()
    ref_loss = ref_loss / n_ref
    ref_loss.backward()
    backend = apply_context_parallel(model, cp_mesh=cp_mesh, backend="te")
    packed = {
        "input_ids": torch.cat([d for d, _ in per_doc], dim=1).cuda(),
        "labels": torch.cat([lab for _, lab in per_doc], dim=1).cuda(),
        "seq_lens": torch.tensor([[24, 40, 16]]).cuda(),
    }
    return backend, _cp_step_errors(model, ref_model, ref_loss, cp_mesh, packed, backend)


CASES = {"torch": torch_backend_parity, "te": te_packed_parity}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's arguments (test_gpu.py's `worker_args`; a CPU test parses those too)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=sorted(CASES), required=True)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        cp_mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("cp",))
        backend, errs = CASES[args.backend](cp_mesh)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, errs)
        if dist.get_rank() == 0:
            report = {
                "backend": backend,
                "errors": gathered,
                "world_size": dist.get_world_size(),
                "device": torch.cuda.get_device_name(device),
            }
            Path(args.out).write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
