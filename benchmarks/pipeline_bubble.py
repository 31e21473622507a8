"""Pipeline bubble per schedule: measured idle fraction per rank vs theory, plus a timeline picture.

Stages have equal, known cost: each stage is one block whose forward sleeps F and whose backward
sleeps F for the input gradient and F for the weight gradient (so zero-bubble schedules can split
them). Sleeping instead of computing keeps p ranks honest on a 2-core machine. Every schedule runs
through AutoPipeline on real gloo ranks; the second step is measured.

    uv run --frozen python benchmarks/pipeline_bubble.py --pp 4 --microbatches 8 --cost-ms 10
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline import AutoPipeline, PipelineConfig
from automodel.testing.ranks import run_on_ranks

SCHEDULES = ["gpipe", "1f1b", "interleaved1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
SINGLE_STAGE = {"gpipe", "1f1b"}


class _Cost(torch.autograd.Function):
    """Identity whose forward/backward sleep a fixed time and log (kind, stage, start, end)."""

    @staticmethod
    def forward(ctx, x, seconds, fwd_kind, bwd_kind, stage, log):
        ctx.info = (seconds, bwd_kind, stage, log)
        if fwd_kind:
            _sleep_logged(seconds, fwd_kind, stage, log)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        seconds, bwd_kind, stage, log = ctx.info
        _sleep_logged(seconds, bwd_kind, stage, log)
        return grad, None, None, None, None, None


def _sleep_logged(seconds: float, kind: str, stage: int, log: list) -> None:
    start = time.time()
    time.sleep(seconds)
    log.append((kind, stage, start, time.time()))


class CostBlock(nn.Module):
    """y = cost(x @ W): forward F, input-grad F (autograd Function), weight-grad F (parameter hook)."""

    def __init__(self, stage: int, seconds: float, log: list) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(8))
        self.stage, self.seconds, self.log = stage, seconds, log
        self.weight.register_hook(self._weight_grad_cost)

    def _weight_grad_cost(self, grad: torch.Tensor) -> torch.Tensor:
        _sleep_logged(self.seconds, "W", self.stage, self.log)
        return grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Cost.apply(x @ self.weight, self.seconds, "F", "B", self.stage, self.log)


def _rank(schedule: str, pp: int, microbatches: int, seconds: float) -> dict:
    mesh = MeshContext.build(ParallelismSizes(pp_size=pp))
    num_stages = pp if schedule in SINGLE_STAGE else 2 * pp
    log: list = []
    model = nn.Sequential(*[CostBlock(s, seconds, log) for s in range(num_stages)])
    config = PipelineConfig(
        pp_schedule=schedule,
        pp_batch_size=microbatches,
        pp_microbatch_size=1,
        module_fqns_per_model_part=[[str(s)] for s in range(num_stages)],
    )
    pipe = AutoPipeline(mesh=mesh, config=config).build(model, loss_fn=lambda out, y: (out * y).sum())
    x = torch.randn(microbatches, 8)
    for _ in range(2):  # the first step also exchanges shapes
        log.clear()
        dist.barrier()
        start = time.time()
        pipe.step(x, labels=x)
        end = time.time()
    return {"start": start, "end": end, "events": list(log), "stages": pipe.stage_ids}


def theory(schedule: str, p: int, m: int) -> float | None:
    """Bubble fraction of the classic analyses (None where no simple closed form applies)."""
    if schedule in SINGLE_STAGE:
        return (p - 1) / (m + p - 1)
    if schedule in ("interleaved1f1b", "looped_bfs"):
        return (p - 1) / (2 * m + p - 1)  # v = 2 virtual stages per rank
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--cost-ms", type=float, default=10.0)
    parser.add_argument("--png", default="docs/pipeline_timeline.png")
    args = parser.parse_args()
    p, m, seconds = args.pp, args.microbatches, args.cost_ms / 1000
    results = {}
    print(f"pp={p} micro-batches={m} F=I=W={args.cost_ms:g} ms per stage (B = I + W)")
    print(
        f"{'schedule':<16} {'step ms':>8} {'vs 1f1b':>8} {'idle/rank (measured)':<34} {'mean':>6} {'theory':>7}"
    )
    for schedule in SCHEDULES:
        ranks = run_on_ranks(_rank, world_size=p, args=(schedule, p, m, seconds), timeout_s=600)
        t0, t1 = min(r["start"] for r in ranks), max(r["end"] for r in ranks)
        wall = t1 - t0
        idle = [1 - sum(e[3] - e[2] for e in r["events"]) / wall for r in ranks]
        results[schedule] = (t0, wall, ranks, idle)
    base = results["1f1b"][1]
    for schedule, (_, wall, _, idle) in results.items():
        th = theory(schedule, p, m)
        per_rank = " ".join(f"{v:.2f}" for v in idle)
        print(
            f"{schedule:<16} {wall * 1000:8.0f} {wall / base:8.2f} {per_rank:<34} {sum(idle) / len(idle):6.2f} "
            f"{'-' if th is None else f'{th:.2f}':>7}"
        )
    _plot(results, Path(args.png))


def _plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no timeline picture")
        return
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.6 * len(results)), squeeze=False)
    for ax, (schedule, (t0, wall, ranks, idle)) in zip(axes[:, 0], results.items()):
        for rank, r in enumerate(ranks):
            for kind, stage, s, e in r["events"]:
                ax.broken_barh([((s - t0) * 1000, (e - s) * 1000)], (rank - 0.4, 0.8), color=colors[kind])
                ax.text((s + e - 2 * t0) * 500, rank, str(stage), ha="center", va="center", fontsize=5)
        ax.set_ylim(len(ranks) - 0.5, -0.5)
        ax.set_yticks(range(len(ranks)), [f"rank {i}" for i in range(len(ranks))], fontsize=6)
        ax.set_title(f"{schedule}: {wall * 1000:.0f} ms, mean idle {sum(idle) / len(idle):.2f}", fontsize=8)
        ax.tick_params(axis="x", labelsize=6)
    axes[-1, 0].set_xlabel("ms (blue F, orange B input-grad, green W weight-grad; numbers are stage ids)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    print(f"timeline: {path}")


if __name__ == "__main__":
    main()
