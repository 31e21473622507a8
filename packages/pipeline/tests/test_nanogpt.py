"""nanoGPT's ``GPT`` (its model.py as written, `nanogpt_model`) pipelined through its own forward
with `LayerListForward`: losses, every gradient (the tied wte/lm_head one included) and the last
stage's logits match one process within 1e-5, on pp2 (1F1B) and on 4 stages (Interleaved1F1B).

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


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets[::3, -4:] = -1  # nanoGPT's ignore index, unevenly over the micro-batches
    return ids, targets


def reference() -> tuple[list[float], list[dict[str, torch.Tensor]], torch.Tensor]:
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        ids, targets = batch(step)
        _, loss = model(ids, targets)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        logits, _ = model(*batch(0))  # with targets: logits of every position
    return losses, grads, logits


def _nanogpt_ranks(schedule: str, num_stages: int) -> dict:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
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
            / tokens[0]
        ),
        parallelize_fn=STAGE_FORWARD,
    )
    opt = torch.optim.SGD(list(pipe.parameters()), lr=LR)
    out: dict = {"losses": [], "grads": [], "stage_ids": pipe.stage_ids}
    for step in range(STEPS):
        ids, targets = batch(step)
        tokens[0] = int((targets != -1).sum())
        out["losses"].append(pipe.reduce_loss(pipe.step(ids, labels=targets)).item())
        out["grads"].append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["logits"] = pipe.eval(batch(0)[0])
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
