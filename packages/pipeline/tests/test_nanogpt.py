"""nanoGPT's ``GPT`` (its model.py as written, `nanogpt_model`) pipelined through its own forward
with `LayerListForward`: losses, every gradient (the tied wte/lm_head one included) and the last
stage's logits match one process within 1e-5, on pp2 (1F1B), on 4 stages (Interleaved1F1B), and
composed with DDP (pp2 x dp2).

The one-process reference is nanoGPT's own loss path, ``model(idx, targets)`` (mean CE over the
batch, ``ignore_index=-1``); the pipeline's loss divides the summed CE by the batch's label count.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline import AutoPipeline, LayerListForward, PipelineConfig
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from nanogpt_model import GPT, GPTConfig  # noqa: E402

VOCAB, SEQ, BATCH, MICRO, STEPS, LR = 64, 12, 8, 2, 2, 0.5
#: nanoGPT's forward: positions and embeddings, the blocks in transformer.h, ln_f, the head
STAGE_FORWARD = LayerListForward(
    layers="transformer.h",
    before=["transformer.wte", "transformer.wpe", "transformer.drop"],
    after=["transformer.ln_f", "lm_head"],
)
PRE = ["transformer.wte", "transformer.wpe", "transformer.drop"]
POST = ["transformer.ln_f", "lm_head", "transformer.wte"]  # the tied wte on the last stage too
FQNS = {
    2: [[*PRE, "transformer.h.0", "transformer.h.1"], ["transformer.h.2", "transformer.h.3", *POST]],
    4: [[*PRE, "transformer.h.0"], ["transformer.h.1"], ["transformer.h.2"], ["transformer.h.3", *POST]],
}


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=VOCAB, n_layer=4, n_head=2, n_embd=16, dropout=0.0))


def batch(step: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    targets[::3, -4:] = -1  # nanoGPT's ignore index, unevenly over the micro-batches
    return ids, targets


def reference(rows: int = BATCH) -> tuple[list[float], list[dict[str, torch.Tensor]], torch.Tensor]:
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        ids, targets = batch(step, rows)
        _, loss = model(ids, targets)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        logits, _ = model(*batch(0, rows))  # with targets: logits of every position
    return losses, grads, logits


def _nanogpt_ranks(schedule: str, num_stages: int, ddp: bool = False) -> dict:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    dp, dp_rank = mesh.size("dp_shard"), mesh.coordinates["dp_shard"]

    def stage_forward_in_ddp(stage: torch.nn.Module, **kw: int) -> torch.nn.Module:
        dp_group = mesh.get_mesh("dp_shard").get_group()
        return DistributedDataParallel(STAGE_FORWARD(stage, **kw), process_group=dp_group)

    config = PipelineConfig(
        pp_schedule=schedule,
        pp_batch_size=BATCH,
        pp_microbatch_size=MICRO,
        module_fqns_per_model_part=FQNS[num_stages],
    )
    tokens = [1]
    pipe = AutoPipeline(mesh=mesh, config=config).build(
        gpt(),
        loss_fn=lambda logits, targets: (
            F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="sum")
            * dp  # DDP averages over dp
            / tokens[0]
        ),
        parallelize_fn=stage_forward_in_ddp if ddp else STAGE_FORWARD,
    )
    rows = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
    opt = torch.optim.SGD(list(pipe.parameters()), lr=LR)
    out: dict = {"losses": [], "grads": [], "stage_ids": pipe.stage_ids}
    for step in range(STEPS):
        ids, targets = batch(step, BATCH * dp)
        tokens[0] = int((targets != -1).sum())  # global: every dp rank's rows
        loss = pipe.reduce_loss(pipe.step(ids[rows], labels=targets[rows])) / dp
        if dp > 1:
            dist.all_reduce(loss, group=mesh.get_mesh("dp_shard").get_group())
        out["losses"].append(loss.item())
        out["grads"].append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["logits"] = pipe.eval(batch(0, BATCH * dp)[0][rows])
    dist.barrier()
    return out


@pytest.mark.parametrize(("schedule", "num_stages"), [("1f1b", 2), ("interleaved1f1b", 4)])
def test_nanogpt_matches_single_process(schedule: str, num_stages: int) -> None:
    ref_losses, ref_grads, ref_logits = reference()
    results = run_on_ranks(_nanogpt_ranks, world_size=2, args=(schedule, num_stages), timeout_s=300)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
    for step in range(STEPS):
        seen: dict[str, int] = {}
        for r in results:
            for name, grad in r["grads"][step].items():
                torch.testing.assert_close(grad, ref_grads[step][name], rtol=1e-5, atol=1e-6, msg=name)
                seen[name] = seen.get(name, 0) + 1
        assert set(seen) == set(ref_grads[step])
        assert seen["transformer.wte.weight"] == 2  # the tied weight: the first and the last stage
    # eval(): logits of every position on the rank holding the last stage (rank 1), None on the other
    assert results[0]["logits"] is None
    torch.testing.assert_close(results[1]["logits"], ref_logits, rtol=1e-5, atol=1e-6)


def test_nanogpt_in_ddp_pp2_dp2_matches_single_process() -> None:
    """`LayerListForward` composed with DDP (pp2 x dp2): the whole 16-row batch of one process."""
    ref_losses, ref_grads, ref_logits = reference(rows=2 * BATCH)
    results = run_on_ranks(_nanogpt_ranks, world_size=4, args=("1f1b", 2, True), timeout_s=300)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for step in range(STEPS):
            for name, grad in r["grads"][step].items():
                torch.testing.assert_close(grad, ref_grads[step][name], rtol=1e-5, atol=1e-6, msg=name)
    last = [r["logits"] for r in results if r["logits"] is not None]  # the last stage's two dp ranks
    torch.testing.assert_close(torch.cat(last), ref_logits, rtol=1e-5, atol=1e-6)
