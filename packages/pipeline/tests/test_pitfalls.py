"""The standalone package's pitfalls, each closed (issue 34): eval without labels on every schedule,
a stage error on one rank raised on every rank (never a wait), a bad input on one rank refused on
every rank, tied weights synced inside `step` (accumulation included) on the HF and the generic
path, and refusals that name ``module_fqns_per_model_part`` for models that are not transformers'.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline import AutoPipeline, PipelineConfig, PipelineModel
from automodel.pipeline.forward_only import PipelineStageError
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from test_parity import BATCH, MICRO, make_batch, tiny_llama, token_loss  # noqa: E402

from automodel.testing.torch_rules import names_a_v_schedule, v_schedules_run_on_gloo  # noqa: E402

TIMEOUT = 300
SCHEDULES = tuple(
    s
    for s in (
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    )
    if v_schedules_run_on_gloo() or not names_a_v_schedule(s)  # torch 2.11: see automodel.testing.torch_rules
)


def _pipe(schedule: str, model: nn.Module, **config) -> PipelineModel:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    cfg = PipelineConfig(pp_batch_size=BATCH, pp_microbatch_size=MICRO, pp_schedule=schedule, **config)
    return AutoPipeline(mesh=mesh, config=cfg).build(model, loss_fn=lambda lo, la: token_loss(lo, la, 10))


def _eval_logits_every_schedule() -> dict[str, list | None]:
    ids, _ = make_batch(0)
    out = {}
    for schedule in SCHEDULES:
        pipe = _pipe(schedule, tiny_llama(layers=4))
        logits = pipe.eval(ids)  # built with a loss_fn, called without labels
        out[schedule] = None if logits is None else logits.tolist()
    dist.barrier()
    return out


def test_eval_without_labels_gives_logits_on_every_schedule() -> None:
    ids, _ = make_batch(0)
    with torch.no_grad():
        ref = tiny_llama(layers=4)(input_ids=ids).logits
    results = run_on_ranks(_eval_logits_every_schedule, world_size=2, timeout_s=TIMEOUT)
    for schedule in SCHEDULES:
        got = [r[schedule] for r in results if r[schedule] is not None]
        assert len(got) == 1, schedule  # the rank holding the last stage
        torch.testing.assert_close(torch.tensor(got[0]), ref, rtol=1e-5, atol=1e-5, msg=schedule)


def _stage_error_then_recover(schedule: str) -> list[str]:
    pipe = _pipe(schedule, tiny_llama(layers=4))
    ids, labels = make_batch(0)
    seen = []
    last_part = (
        pipe.model_parts[[st.is_last for st in pipe.stages].index(True)] if pipe.has_last_stage else None
    )
    original = last_part.forward if last_part is not None else None
    if last_part is not None:
        last_part.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom in the head"))
    try:
        pipe.eval(ids, labels=labels)
    except PipelineStageError as e:  # a notebook catches it and goes on
        seen.append(str(e))
    if last_part is not None:
        setattr(last_part, "forward", original)  # noqa: B010 - an instance attribute shadows the method
    seen.append(f"again {pipe.reduce_loss(pipe.eval(ids, labels=labels)).item():.4f}")
    try:  # labels forgotten: refused on every rank, not only on the last stage's
        pipe.step(ids)
    except ValueError as e:
        seen.append(f"step: {e}")
    dist.barrier()
    return seen


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_a_stage_error_in_eval_is_raised_on_every_rank(schedule: str) -> None:
    results = run_on_ranks(_stage_error_then_recover, world_size=2, args=(schedule,), timeout_s=TIMEOUT)
    for seen in results:
        assert re.match(
            r"pipeline stage \d \(pp rank \d\) failed in its forward: RuntimeError: boom", seen[0]
        )
        assert seen[1] == results[0][1]  # the pipeline still works afterwards, the same loss everywhere
        assert "labels is required on the rank that holds the last pipeline stage" in seen[2]


from automodel.testing.faults import FULL  # noqa: E402

_LOSS_FAILS = {"on": False}  # set inside a rank (each forked rank has its own copy)


def _failing_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if _LOSS_FAILS["on"]:
        raise ValueError("boom in the loss")
    return token_loss(logits, labels, 10)


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, *grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in the backward")


def _step_error_then_step(schedule: str, phase: str) -> dict:
    """Rank body: rank 1's first stage (rank 0's for "forward_rank0", or the loss) raises inside
    `step`; the caller catches the error, restores the stage and steps again."""
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    cfg = PipelineConfig(pp_batch_size=BATCH, pp_microbatch_size=MICRO, pp_schedule=schedule)
    pipe = AutoPipeline(mesh=mesh, config=cfg).build(tiny_llama(layers=4), loss_fn=_failing_loss)
    ids, labels = make_batch(0)
    if phase != "first":  # a good step first: the error comes from inside the schedule
        pipe.step(ids, labels=labels)
        for p in pipe.parameters():
            p.grad = None
    failing_rank = 0 if phase == "forward_rank0" else 1
    part = pipe.model_parts[0] if dist.get_rank() == failing_rank else None
    forward = part.forward if part is not None else None

    def failing_forward(*args: object, **kwargs: object) -> object:
        assert forward is not None
        if phase == "first" or torch.is_grad_enabled():  # "forward": only inside the schedule
            raise RuntimeError("boom in the stage")
        return forward(*args, **kwargs)

    def backward_fails(*args: object, **kwargs: object) -> object:
        assert forward is not None
        out = forward(*args, **kwargs)
        return _RaisesInBackward.apply(out) if isinstance(out, torch.Tensor) else out

    if part is not None and phase in ("first", "forward", "forward_rank0"):
        part.forward = failing_forward
    if part is not None and phase == "backward":
        part.forward = backward_fails
    _LOSS_FAILS["on"] = phase == "loss_fn"
    start = time.perf_counter()
    try:
        pipe.step(ids, labels=labels)
        error = "no error"
    except PipelineStageError as e:
        error = str(e)
    elapsed = time.perf_counter() - start
    _LOSS_FAILS["on"] = False
    if part is not None:
        setattr(part, "forward", forward)  # noqa: B010 - an instance attribute shadows the method
    grads_dropped = all(p.grad is None for p in pipe.parameters())
    again = pipe.reduce_loss(pipe.step(ids, labels=labels)).item()
    dist.barrier()
    return {"error": error, "elapsed": elapsed, "grads_dropped": grads_dropped, "again": again}


_STEP_CASES = [
    ("1F1B", "first"),
    ("1F1B", "forward"),
    ("Interleaved1F1B", "loss_fn"),
    ("GPipe", "forward_rank0"),
    ("ZBVZeroBubble", "backward"),
]
_STEP_CASES_ALL = [
    pytest.param(s, p, marks=pytest.mark.skipif(not FULL, reason="in `nox -s faults` (AUTOMODEL_FAULTS=all)"))
    for s in SCHEDULES
    for p in ("first", "forward", "forward_rank0", "loss_fn", "backward")
    if (s, p) not in _STEP_CASES
]


@pytest.mark.parametrize(("schedule", "phase"), [*_STEP_CASES, *_STEP_CASES_ALL])
def test_a_stage_error_inside_step_is_raised_on_every_rank(schedule: str, phase: str) -> None:
    """Not a wait until the process-group timeout: every rank raises the same error, naming the
    stage and its rank, within seconds; the step's gradients are dropped and the next step is exact."""
    ids, labels = make_batch(0)
    ref = token_loss(tiny_llama(layers=4)(input_ids=ids).logits, labels, 10).item()
    results = run_on_ranks(_step_error_then_step, world_size=2, args=(schedule, phase), timeout_s=TIMEOUT)
    v_shape = schedule in ("ZBVZeroBubble", "DualPipeV")
    if phase == "forward_rank0":
        stage, rank = 0, 0
    elif phase == "loss_fn":  # the last stage: 3 of 4 on multi-stage schedules, on rank 0 when V-shaped
        stage, rank = (3 if schedule not in ("GPipe", "1F1B") else 1), (0 if v_shape else 1)
    else:
        stage, rank = 1, 1
    where = "forward" if phase in ("first", "forward", "forward_rank0") else phase
    expected = (
        rf"pipeline stage {stage} \(pp rank {rank}\) failed in its {where}"
        + (": " if phase == "first" else r" during step\(\): ")  # "first": the forward-only check
        + r"\w+Error: boom in the"
    )
    for r in results:
        assert re.match(expected, r["error"]), (expected, r["error"])
        assert r["error"] == results[0]["error"]
        assert r["elapsed"] < 10.0
        assert r["grads_dropped"]
        assert r["again"] == pytest.approx(ref, rel=1e-5)


def _tied_grads(schedule: str, accumulate: int, call_sync: bool) -> dict[str, list]:
    """Rank body: the gradient of every copy of the tied weight this rank holds (one per stage)."""
    model = tiny_llama(layers=4)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    pipe = _pipe(schedule, model)
    for step in range(accumulate):
        ids, labels = make_batch(step)
        pipe.step(ids, labels=labels)
    if call_sync:
        pipe.sync_tied_gradients()  # the old explicit call: harmless now
    dist.barrier()
    return {
        f"{i}:{n}": p.grad.tolist()
        for i, part in enumerate(pipe.model_parts)
        for n, p in part.named_parameters()
        if "embed_tokens" in n or "lm_head" in n
    }


@pytest.mark.parametrize(("schedule", "call_sync"), [("1F1B", False), ("ZBVZeroBubble", True)])
def test_tied_gradients_are_synced_inside_step(schedule: str, call_sync: bool) -> None:
    """Two accumulating `step` calls on a tied model equal one process, without `sync_tied_gradients`."""
    model = tiny_llama(layers=4)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    for step in range(2):
        ids, labels = make_batch(step)
        token_loss(model(input_ids=ids).logits, labels, 10).backward()
    ref = model.model.embed_tokens.weight.grad
    results = run_on_ranks(_tied_grads, world_size=2, args=(schedule, 2, call_sync), timeout_s=TIMEOUT)
    copies = [torch.tensor(g) for r in results for g in r.values()]
    assert len(copies) == 2  # the embedding on the first stage, the tied head on the last
    for got in copies:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


class TinyTitan(nn.Module):
    """A model from another codebase: a ``.config`` attribute, its own forward, tied embedding/head.
    Its forward skips the modules a stage does not hold (as torchtitan's models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = {"dim": 16}
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.output = nn.Linear(16, 32, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # token ids on the first stage; the last stage holds the embedding only for the tie
        h = self.tok_embeddings(x) if self.tok_embeddings is not None and not x.is_floating_point() else x
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def _titan(fqns: list[list[str]] | None) -> object:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    cfg = PipelineConfig(
        pp_batch_size=4, pp_microbatch_size=2, pp_schedule="1F1B", module_fqns_per_model_part=fqns
    )
    try:
        pipe = AutoPipeline(mesh=mesh, config=cfg).build(
            TinyTitan(),
            loss_fn=lambda lo, la: nn.functional.cross_entropy(
                lo.flatten(0, 1), la.flatten(), reduction="sum"
            ),
        )
    except ValueError as e:
        return f"ValueError: {e}"
    ids = torch.arange(24).reshape(4, 6) % 32
    pipe.step(ids, labels=(ids + 1) % 32)
    dist.barrier()
    return {
        n: p.grad.tolist()
        for n, p in pipe.named_parameters()
        if n in ("tok_embeddings.weight", "output.weight")
    }


def test_a_model_that_is_not_transformers_is_refused_naming_module_fqns() -> None:
    for result in run_on_ranks(_titan, world_size=2, args=(None,), timeout_s=TIMEOUT):
        assert result.startswith("ValueError: TinyTitan is not a Hugging Face transformers model")
        assert "module_fqns_per_model_part" in result


def test_tied_weights_on_the_generic_path() -> None:
    fqns = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output", "tok_embeddings"]]
    model = TinyTitan()
    ids = torch.arange(24).reshape(4, 6) % 32
    nn.functional.cross_entropy(
        model(ids).flatten(0, 1), ((ids + 1) % 32).flatten(), reduction="sum"
    ).backward()
    ref = model.tok_embeddings.weight.grad
    results = run_on_ranks(_titan, world_size=2, args=(fqns,), timeout_s=TIMEOUT)
    copies = [torch.tensor(g) for r in results for g in r.values()]
    assert copies, results
    for got in copies:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
