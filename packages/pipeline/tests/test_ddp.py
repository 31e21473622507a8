"""pp2 x dp2 with the user's own `DistributedDataParallel` around each stage (`parallelize_fn`), on a
model whose embedding is tied to its head across the first and last stage (4 gloo ranks).

DDP names parameters ``module.<fqn>``; the pipeline sees through it (tied copies are paired by
their full-model FQN, `named_parameters()` gives full-model FQNs). DDP skips its all-reduce on all
but the last micro-batch (torch's stage runs the others under ``no_sync``) and averages over dp, so
a loss divided by the global label-token count and multiplied by the dp size gives exactly the
whole-batch gradients of one process: checked here for several micro-batches and accumulating steps.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline import AutoPipeline, PipelineConfig
from automodel.testing.ranks import run_on_ranks, run_torchrun

VOCAB, DIM, SEQ, BATCH, MICRO, DP, STEPS, LR = 32, 16, 6, 4, 1, 2, 2, 0.5
FQNS = [["wte", "h.0", "h.1"], ["h.2", "h.3", "ln_f", "lm_head", "wte"]]
FQNS_4 = [["wte", "h.0"], ["h.1"], ["h.2"], ["h.3", "ln_f", "lm_head", "wte"]]  # two stages per rank


class TiedGPT(nn.Module):
    """GPT-style: token embedding tied to the LM head; its forward skips the modules a stage lacks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(4))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) if self.wte is not None and not x.is_floating_point() else x
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h)) if self.lm_head is not None else h


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (every dp rank's rows)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH * DP, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH * DP, SEQ), generator=g)
    labels[::3, -2:] = -100  # uneven token counts over micro-batches and dp ranks
    return ids, labels


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def reference(accumulate: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = TiedGPT()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        total = 0.0
        for micro_step in range(accumulate):
            ids, labels = batch(step * accumulate + micro_step)
            loss = ce_sum(model(ids), labels) / int((labels != -100).sum())
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def _ddp_ranks(schedule: str, accumulate: int) -> dict:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    dp_group = mesh.get_mesh("dp_shard").get_group()

    def wrap(stage: nn.Module, *, stage_index: int, num_stages: int) -> nn.Module:
        return DistributedDataParallel(stage, process_group=dp_group)

    tokens = [1]
    config = PipelineConfig(
        pp_schedule=schedule,
        pp_batch_size=BATCH,
        pp_microbatch_size=MICRO,
        module_fqns_per_model_part=FQNS if schedule in ("1f1b", "gpipe") else FQNS_4,
    )
    pipe = AutoPipeline(mesh=mesh, config=config).build(
        TiedGPT(),
        # DDP averages over dp: times dp, a loss over the global token count sums to the whole batch's
        loss_fn=lambda logits, labels: ce_sum(logits, labels) * DP / tokens[0],
        parallelize_fn=wrap,
    )
    dp_rank = mesh.coordinates["dp_shard"]
    rows = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
    opt = torch.optim.SGD(list(pipe.parameters()), lr=LR)
    out: dict = {"losses": [], "grads": [], "wrapped": [type(p).__name__ for p in pipe.model_parts]}
    for step in range(STEPS):
        total = torch.zeros(())
        for micro_step in range(accumulate):
            ids, labels = batch(step * accumulate + micro_step)
            tokens[0] = int((labels != -100).sum())  # global: both dp ranks' rows
            loss = pipe.reduce_loss(pipe.step(ids[rows], labels=labels[rows])) / DP
            dist.all_reduce(loss, group=dp_group)
            total += loss
        out["losses"].append(total.item())
        out["grads"].append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        opt.step()
        opt.zero_grad()
    dist.barrier()
    return out


@pytest.mark.parametrize(
    ("schedule", "accumulate"), [("1f1b", 1), ("gpipe", 2), ("interleaved1f1b", 1), ("looped_bfs", 2)]
)
def test_pp2_ddp2_tied_matches_single_process(schedule: str, accumulate: int) -> None:
    ref_losses, ref_grads = reference(accumulate)
    results = run_on_ranks(_ddp_ranks, world_size=4, args=(schedule, accumulate), timeout_s=300)
    for r in results:
        assert set(r["wrapped"]) == {"DistributedDataParallel"}
        for step in range(STEPS):
            assert r["losses"][step] == pytest.approx(ref_losses[step], rel=1e-5)
    for step in range(STEPS):
        seen = set()
        for r in results:
            for name, grad in r["grads"][step].items():
                ref = ref_grads[step][name]
                # 1e-5 of the tensor's scale: fp32 sums in another order (one thread, as torch_range
                # runs) differ by ~1.6e-6 on entries of 0.36 after one SGD step
                atol = 1e-5 * float(ref.abs().max())
                torch.testing.assert_close(grad, ref, rtol=1e-5, atol=atol, msg=name)
                seen.add(name)
        # full-model FQNs, no "module." prefix; the tied weight as wte.weight on both stages
        assert seen == set(ref_grads[step]), seen


def _ddp_build_error(schedule: str) -> str:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    dp_group = mesh.get_mesh("dp_shard").get_group()
    config = PipelineConfig(
        pp_schedule=schedule, pp_batch_size=BATCH, pp_microbatch_size=MICRO, module_fqns_per_model_part=FQNS_4
    )
    try:
        AutoPipeline(mesh=mesh, config=config).build(
            TiedGPT(),
            loss_fn=ce_sum,
            parallelize_fn=lambda stage, **_: DistributedDataParallel(stage, process_group=dp_group),
        )
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv", "dualpipev"])
def test_ddp_under_a_split_backward_schedule_is_refused(schedule: str) -> None:
    """Their weight pass sets the gradients itself: DDP's hooks never run, dp would drift apart."""
    for message in run_on_ranks(_ddp_build_error, world_size=4, args=(schedule,), timeout_s=300):
        assert "in DistributedDataParallel, but pp_schedule" in message, message
        assert "splits each backward into an input and a weight pass" in message
        assert "with DDP use a schedule with full backward passes (gpipe, 1f1b, interleaved1f1b" in message


TEARDOWN_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from automodel.mesh import MeshContext, ParallelismSizes, destroy_distributed, init_distributed
    from automodel.pipeline import AutoPipeline, PipelineConfig

    init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    config = PipelineConfig(pp_batch_size=4, pp_microbatch_size=2, module_fqns_per_model_part=[["0", "1"], ["2", "3"]])


    def wrap(stage, **_):
        return DistributedDataParallel(stage, process_group=mesh.get_mesh("dp_shard").get_group())


    pipe = AutoPipeline(mesh=mesh, config=config).build(
        model, loss_fn=lambda out, y: ((out - y) ** 2).sum(), parallelize_fn=wrap
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    loss = pipe.reduce_loss(pipe.step(torch.randn(4, 8), labels=torch.randn(4, 8)))
    opt.step()
    print(f"rank {mesh.rank} loss {loss.item():.4f}")
    destroy_distributed()
    """
)


def test_ddp_stages_release_their_group_at_destroy_distributed(tmp_path: Path) -> None:
    """`pipe` (and through it the DDP stages and their reducers) is still in the script's scope when
    destroy_distributed() runs: the dp group's gloo threads must not outlive it."""
    script = tmp_path / "ddp_teardown.py"
    script.write_text(TEARDOWN_SCRIPT)
    proc = run_torchrun(script, nproc_per_node=4, timeout_s=300, cwd=tmp_path)
    # the ranks share one stdout pipe: their lines may interleave
    assert sorted(re.findall(r"rank (\d) loss", proc.stdout)) == list("0123"), proc.stdout
    assert "outlive" not in proc.stderr and "RuntimeWarning" not in proc.stderr, proc.stderr[-4000:]
