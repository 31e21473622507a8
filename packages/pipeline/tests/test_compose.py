"""PP composed with FSDP2 (dp=2) and with TP (tp=2) on 4 ranks, through `parallelize_fn`.

The parallelizers here are torch's own `fully_shard` / `parallelize_module` (this package imports
no sibling). FSDP2 sums gradients (divide factor 1.0) and the loss is normalised by the label
tokens of both dp ranks, as the recipes do, so gradients equal the whole-batch reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.mesh.reduction import set_unit_gradient_divide_factor
from automodel.pipeline import AutoPipeline, PipelineConfig
from automodel.testing.ranks import run_on_ranks
from automodel.testing.tiny_model import tiny_llama

sys.path.insert(0, str(Path(__file__).parent))
import test_parity as H  # noqa: E402  (its tiny model, batches and one-process reference)

LAYERS = 4
TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def _count_reduce_scatters(counter: list[int]) -> None:
    """Count FSDP2's gradient reductions (the real collective still runs)."""
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            real = getattr(dist, name)

            def counting(*args, _real=real, **kwargs):
                counter[0] += 1
                return _real(*args, **kwargs)

            setattr(dist, name, counting)


def _compose_ranks(mode: str, schedule: str) -> dict:
    if mode == "fsdp":
        mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    else:
        mesh = MeshContext.build(ParallelismSizes(pp_size=2, tp_size=2))

    def parallelize(stage, *, stage_index: int, num_stages: int):
        assert 0 <= stage_index < num_stages
        if mode == "tp":
            for layer in stage.model.layers:
                parallelize_module(layer, mesh.get_mesh("tp"), TP_PLAN)
            return stage
        dp_mesh = mesh.get_mesh("dp_shard")
        for layer in stage.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(stage, mesh=dp_mesh)
        for module in stage.modules():
            if isinstance(module, FSDPModule):
                set_unit_gradient_divide_factor(module, factor=1.0)
        return None

    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=H.BATCH, pp_microbatch_size=H.MICRO)
    tokens = [0]
    pipe = AutoPipeline(mesh=mesh, config=config).build(
        tiny_llama(layers=LAYERS),
        loss_fn=lambda logits, labels: H.token_loss(logits, labels, tokens[0]),
        parallelize_fn=parallelize,
    )
    dp_rank, dp = mesh.coordinates["dp_shard"], mesh.size("dp_shard")
    opt = torch.optim.SGD(list(pipe.parameters()), lr=H.LR)
    counter = [0]
    _count_reduce_scatters(counter)
    out: dict = {"losses": [], "grads": [], "reduce_scatters": [], "fsdp_modules": 0}
    for step in range(H.STEPS):
        ids, labels = H.make_batch(step, rows=H.BATCH * dp)
        tokens[0] = int((labels != -100).sum())  # global: both dp ranks' rows
        rows = slice(dp_rank * H.BATCH, (dp_rank + 1) * H.BATCH)
        counter[0] = 0
        loss = pipe.reduce_loss(pipe.step(ids[rows], labels=labels[rows]))
        out["reduce_scatters"].append(counter[0])
        dist.all_reduce(loss, group=mesh.get_mesh("dp_shard").get_group())
        out["losses"].append(loss.item())
        out["grads"].append({n: H._full(p.grad).detach().clone() for n, p in pipe.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["fsdp_modules"] = sum(isinstance(m, FSDPModule) for part in pipe.model_parts for m in part.modules())
    return out


def test_pp2_fsdp2_dp2_matches_and_defers_grad_sync() -> None:
    ref_losses, ref_grads = H.reference(LAYERS, rows=2 * H.BATCH)
    results = run_on_ranks(_compose_ranks, world_size=4, args=("fsdp", "1f1b"), timeout_s=H.TIMEOUT)
    H._assert_parity(results, ref_losses, ref_grads)
    for r in results:
        # one reduce-scatter per FSDP group per step, not one per micro-batch
        assert r["reduce_scatters"] == [r["fsdp_modules"]] * H.STEPS, r


def test_pp2_tp2_matches_single_process() -> None:
    ref_losses, ref_grads = H.reference(LAYERS)
    results = run_on_ranks(_compose_ranks, world_size=4, args=("tp", "interleaved1f1b"), timeout_s=H.TIMEOUT)
    H._assert_parity(results, ref_losses, ref_grads)
