"""PP composed with sequence-parallel TP (pp2 x tp2, 4 ranks): the residual stream between stages is
a ``Shard(1)`` DTensor over tp, which crosses each stage boundary as its local shard and is rebuilt
by the next stage from the declared `BoundaryLayout` (`dtensor_boundary`).

The plan is written here with torch's styles (this package imports no sibling): the embedding and
the row-parallel projections output sequence shards, the norms run on them, attention and MLP
gather them; the LM head gathers the logits.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline import AutoPipeline, BoundaryLayout, PipelineConfig
from automodel.pipeline.dtensor_boundary import attach_boundary_layouts
from automodel.testing.ranks import RankFailure, run_on_ranks
from automodel.testing.tiny_model import tiny_llama

sys.path.insert(0, str(Path(__file__).parent))
import test_parity as H  # noqa: E402  (its tiny model, batches and one-process reference)

LAYERS = 4
SEQ = Shard(1)


def _sp_plan(stage: torch.nn.Module) -> dict:
    """The sequence-parallel plan of the modules `stage` holds (keys relative to the stage)."""
    names = {n for n, _ in stage.named_modules()}
    plan: dict = {}
    if "model.embed_tokens" in names:
        plan["model.embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=SEQ, use_local_output=False
        )
    if "model.norm" in names:
        plan["model.norm"] = SequenceParallel()
    if "lm_head" in names:
        plan["lm_head"] = ColwiseParallel(input_layouts=SEQ, output_layouts=Replicate())
    row_out = {"output_layouts": SEQ, "use_local_output": False}
    layer = "model.layers.*."
    plan[f"{layer}input_layernorm"] = SequenceParallel()
    plan[f"{layer}post_attention_layernorm"] = SequenceParallel()
    plan[f"{layer}self_attn"] = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": SEQ}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
    )
    plan[f"{layer}mlp"] = PrepareModuleInput(input_layouts=(SEQ,), desired_input_layouts=(Replicate(),))
    for proj in ("q_proj", "k_proj", "v_proj"):
        plan[f"{layer}self_attn.{proj}"] = ColwiseParallel()
    plan[f"{layer}self_attn.o_proj"] = RowwiseParallel(**row_out)
    plan[f"{layer}mlp.gate_proj"] = ColwiseParallel()
    plan[f"{layer}mlp.up_proj"] = ColwiseParallel()
    plan[f"{layer}mlp.down_proj"] = RowwiseParallel(**row_out)
    return plan


def _sp_ranks(schedule: str, declare: bool) -> dict:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2, tp_size=2))
    tp_mesh = mesh.get_mesh("tp")
    sent: list[tuple] = []

    def parallelize(stage, *, stage_index: int, num_stages: int) -> None:
        parallelize_module(stage, tp_mesh, _sp_plan(stage))
        if stage_index < num_stages - 1:  # what torch's stage sends: recorded after the boundary hook
            stage.register_forward_hook(lambda m, a, out: sent.append((type(out).__name__, tuple(out.shape))))

    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=H.BATCH, pp_microbatch_size=H.MICRO)
    tokens = [0]
    pipe = AutoPipeline(mesh=mesh, config=config).build(
        tiny_llama(layers=LAYERS),
        loss_fn=lambda logits, labels: H.token_loss(logits, labels, tokens[0]),
        parallelize_fn=parallelize,
        boundary_layouts=BoundaryLayout(mesh=tp_mesh, placements=(SEQ,)) if declare else None,
    )
    opt = torch.optim.SGD(list(pipe.parameters()), lr=H.LR)
    out: dict = {"losses": [], "grads": [], "sent": sent, "meta_shapes": _meta_output_shapes(pipe)}
    for step in range(H.STEPS):
        ids, labels = H.make_batch(step)
        tokens[0] = int((labels != -100).sum())
        loss = pipe.reduce_loss(pipe.step(ids, labels=labels))
        out["losses"].append(loss.item())
        out["grads"].append({n: H._full(p.grad).detach().clone() for n, p in pipe.named_parameters()})
        opt.step()
        opt.zero_grad()
    dist.barrier()
    return out


def _meta_output_shapes(pipe) -> dict[int, tuple]:
    """Each stage's output shape from meta inputs (`CausalLMStage`'s shape-only path, for shape
    inference on meta tensors): what is sent must be the local shard's shape, as in a real forward."""
    shapes = {}
    for stage_id, part in zip(pipe.stage_ids, pipe.model_parts):
        if stage_id == 0:
            inputs = torch.empty(H.MICRO, H.SEQ, dtype=torch.long, device="meta")
        else:
            inputs = torch.empty(H.MICRO, H.SEQ // 2, 64, device="meta")
        with torch.no_grad():
            shapes[stage_id] = tuple(part(inputs).shape)
    return shapes


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved1f1b", "zbv"])
def test_pp2_tp2_sequence_parallel_matches_single_process(schedule: str) -> None:
    ref_losses, ref_grads = H.reference(LAYERS)
    results = run_on_ranks(_sp_ranks, world_size=4, args=(schedule, True), timeout_s=H.TIMEOUT)
    H._assert_parity(results, ref_losses, ref_grads)
    sent = {s for r in results for s in r["sent"]}
    # the local shard (half the sequence) crosses, as a plain tensor
    assert sent == {("Tensor", (H.MICRO, H.SEQ // 2, 64))}, sent
    meta = {stage: shape for r in results for stage, shape in r["meta_shapes"].items()}
    last = max(meta)
    assert meta[last] == (H.MICRO, H.SEQ, H.VOCAB)
    assert all(meta[s] == (H.MICRO, H.SEQ // 2, 64) for s in range(last)), meta


def test_undeclared_dtensor_output_is_refused_naming_it() -> None:
    with pytest.raises(RankFailure, match="no boundary layout declares it"):
        run_on_ranks(_sp_ranks, world_size=4, args=("1f1b", False), timeout_s=H.TIMEOUT)


def _round_trip_ranks() -> dict:
    """One boundary by hand on 2 ranks (tp only): the sender's hook sends the local shard, the
    receiver's rebuilds the DTensor, and the gradient each side gets is the local shard of the
    whole gradient (the receiver's column-parallel use of it makes a partial sum, reduce-scattered)."""
    mesh = MeshContext.build(ParallelismSizes(tp_size=2))
    tp_mesh = mesh.get_mesh("tp")
    layout = BoundaryLayout(mesh=tp_mesh, placements=(SEQ,))

    class Send(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> DTensor:
            return DTensor.from_local(x * 2, tp_mesh, (Replicate(),)).redistribute(tp_mesh, (SEQ,))

    class Receive(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []
            weight = torch.ones(3, 4)  # [hidden, out], split over tp by output column
            self.weight = DTensor.from_local(weight.chunk(2, dim=1)[dist.get_rank()], tp_mesh, (Shard(1),))

        def forward(self, h: DTensor) -> torch.Tensor:
            self.seen.append((type(h).__name__, tuple(h.placements), tuple(h.shape)))
            position = DTensor.from_local(torch.arange(1.0, 5.0).reshape(1, 4, 1), tp_mesh, (Replicate(),))
            out = h.redistribute(tp_mesh, (Replicate(),)) @ self.weight  # Shard(2) columns
            return cast(DTensor, (out * position).sum()).full_tensor()

    send, receive = Send(), Receive()
    attach_boundary_layouts(send, layouts=(layout,), stage_index=0, num_stages=2)
    attach_boundary_layouts(receive, layouts=(layout,), stage_index=1, num_stages=2)
    x = torch.ones(1, 4, 3, requires_grad=True)
    local = send(x)
    received = local.detach().requires_grad_(True)  # what torch's stage hands the next stage
    receive(received).backward()
    local.backward(received.grad)
    return {
        "sent": (type(local).__name__, tuple(local.shape), local._is_view()),
        "seen": receive.seen,
        "received_grad": received.grad[0, :, 0].tolist(),
        "input_grad": x.grad[0, :, 0].tolist(),
        "rank": dist.get_rank(),
    }


def test_boundary_hooks_send_local_shards_and_rebuild_with_exact_gradients() -> None:
    results = run_on_ranks(_round_trip_ranks, world_size=2, timeout_s=H.TIMEOUT)
    for r in results:
        assert r["sent"] == ("Tensor", (1, 2, 3), False)
        assert r["seen"] == [("DTensor", (SEQ,), (1, 4, 3))]
        # loss = sum_s,j position[s] * (h @ 1)[s, j]: d/dh[s, k] = 4 * position[s] (4 output columns);
        # rank 0 holds positions 1, 2 and rank 1 positions 3, 4
        expected = [4.0, 8.0] if r["rank"] == 0 else [12.0, 16.0]
        assert r["received_grad"] == expected, r
        assert r["input_grad"] == [8.0, 16.0, 24.0, 32.0], r  # x * 2: whole, on every rank
