"""A weight tied between the first and the last stage, each module listed once where it sits.

Models as their authors write them: a torchtitan-style model (``tok_embeddings.weight =
output.weight``, a forward that runs a module only when the stage holds it), nanoGPT's ``GPT``
(``transformer.wte.weight = lm_head.weight``, run through `LayerListForward`), and transformers
models built with ``tie_word_embeddings=True`` (Llama, GPT-2, Qwen2; split by the package). Every
schedule runs in one 2-rank launch per model family: losses and every gradient equal one process
(fp32, 1e-5), and the layout is asserted: which layers each stage holds, a copy of the tied weight
on the first and on the last stage (under the head's name where the stage holds only the head),
all copies equal to one process's weight after the optimizer steps. The old listing (the embedding
named in the last stage too) still works.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline import AutoPipeline, LayerListForward, PipelineConfig
from automodel.testing.ranks import run_on_ranks
from automodel.testing.tiny_model import tiny_causal_lm
from automodel.testing.torch_rules import names_a_v_schedule, v_schedules_run_on_gloo

sys.path.insert(0, str(Path(__file__).parent))
from nanogpt_model import GPT, GPTConfig  # noqa: E402

VOCAB, DIM, SEQ, BATCH, MICRO, STEPS, LR = 64, 16, 8, 8, 2, 2, 0.5
#: every schedule torch registers, by the package's names; the first two have one stage per rank
#: (the V schedules not on torch 2.11 with gloo: see automodel.testing.torch_rules)
SCHEDULES = [
    s
    for s in ("gpipe", "1f1b", "interleaved1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
    if v_schedules_run_on_gloo() or not names_a_v_schedule(s)
]
#: the stage ids each rank holds: one per rank, two round-robin, two in a V
RANKS = {"single": [[0], [1]], "round_robin": [[0, 2], [1, 3]], "v": [[0, 3], [1, 2]]}
TIMEOUT = 600


def _ranks_of(schedule: str) -> list[list[int]]:
    if schedule in ("gpipe", "1f1b"):
        return RANKS["single"]
    return RANKS["v"] if schedule in ("zbv", "dualpipev") else RANKS["round_robin"]


class TitanLM(nn.Module):
    """torchtitan's way: the output projection's weight is the embedding's (``enable_weight_tying``),
    and the forward runs a module only where the stage holds it (``if self.tok_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for i in range(4)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.tok_embeddings.weight = self.output.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm else h
        return self.output(h) if self.output else h


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=VOCAB, n_layer=4, n_head=2, n_embd=DIM, dropout=0.0))


_NANO_PRE = ["transformer.wte", "transformer.wpe", "transformer.drop"]
_NANO_FORWARD = LayerListForward(
    layers="transformer.h", before=_NANO_PRE, after=["transformer.ln_f", "lm_head"]
)
#: per family: the model, its tied weight's one-process name and its head's, the layer FQN prefix,
#: the stage FQNs for 2 and 4 stages (the embedding listed once), and the parallelize_fn
FAMILIES: dict[str, dict[str, Any]] = {
    "titan": {
        "model": TitanLM,
        "tied": ("tok_embeddings.weight", "output.weight"),
        "layers": "layers",
        "fqns": {
            2: [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]],
            4: [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "output"]],
        },
        "forward": None,
    },
    "nanogpt": {
        "model": _gpt,
        "tied": ("transformer.wte.weight", "lm_head.weight"),
        "layers": "transformer.h",
        "fqns": {
            2: [
                [*_NANO_PRE, "transformer.h.0", "transformer.h.1"],
                ["transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"],
            ],
            4: [
                [*_NANO_PRE, "transformer.h.0"],
                ["transformer.h.1"],
                ["transformer.h.2"],
                ["transformer.h.3", "transformer.ln_f", "lm_head"],
            ],
        },
        "forward": _NANO_FORWARD,
    },
}
#: transformers models built with tie_word_embeddings=True: the package splits them itself (4
#: layers evenly) and names the embedding on the last stage too, under its one-process name
for _model_type, _embed, _layers in (
    ("llama", "model.embed_tokens", "model.layers"),
    ("qwen2", "model.embed_tokens", "model.layers"),
    ("gpt2", "transformer.wte", "transformer.h"),
):
    FAMILIES[f"hf_{_model_type}"] = {
        "model": partial(tiny_causal_lm, _model_type, layers=4, tie_word_embeddings=True),
        "tied": (f"{_embed}.weight", "lm_head.weight"),
        "layers": _layers,
        "fqns": None,
        "forward": None,
        "held_as": f"{_embed}.weight",
    }


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[::3, -3:] = -100  # uneven token counts over the micro-batches
    return ids, labels


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids) if not isinstance(model, GPT) else model(ids, torch.zeros_like(ids))[0]
    return getattr(out, "logits", out)


def one_process(build: Callable[[], nn.Module]) -> dict[str, Any]:
    """SGD steps of the whole model: losses, gradients by name, and the weights after the steps."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        ids, labels = _batch(step)
        loss = _ce_sum(_logits(model, ids), labels) / int((labels != -100).sum())
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return {
        "losses": losses,
        "grads": grads,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _train(pipe: Any, tokens: list[int]) -> dict[str, Any]:
    """STEPS SGD steps through `pipe`: losses, gradients by the names `named_parameters` gives, and
    per stage what it holds (names inside the stage module) and its tied copies' values after."""
    opt = torch.optim.SGD(list(pipe.parameters()), lr=LR)
    out: dict[str, Any] = {"losses": [], "grads": [], "stage_ids": pipe.stage_ids}
    for step in range(STEPS):
        ids, labels = _batch(step)
        tokens[0] = int((labels != -100).sum())
        out["losses"].append(pipe.reduce_loss(pipe.step(ids, labels=labels)).item())
        out["grads"].append({n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    out["held"] = {
        stage: {n: p.detach().clone() for n, p in part.named_parameters(remove_duplicate=False)}
        for stage, part in zip(pipe.stage_ids, pipe.model_parts, strict=True)
    }
    out["one_process_names"] = {n for n, _ in pipe.named_parameters()}
    return out


def _generic_ranks(family: str, schedules: list[str], listed_twice: bool) -> dict[str, Any]:
    """Rank body: one pipeline per schedule, the stage FQNs of `FAMILIES` (with the embedding's
    module also on the last stage: `listed_twice`)."""
    spec = FAMILIES[family]
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    results = {}
    for schedule in schedules:
        fqns = None
        if spec["fqns"] is not None:
            fqns = [list(p) for p in spec["fqns"][2 if schedule in ("gpipe", "1f1b") else 4]]
            if listed_twice:
                fqns[-1].append(spec["tied"][0].rpartition(".")[0])
        tokens = [1]
        config = PipelineConfig(
            pp_schedule=schedule,
            pp_batch_size=BATCH,
            pp_microbatch_size=MICRO,
            module_fqns_per_model_part=fqns,
        )
        pipe = AutoPipeline(mesh=mesh, config=config).build(
            spec["model"](),
            loss_fn=lambda logits, labels, tokens=tokens: _ce_sum(logits, labels) / tokens[0],
            parallelize_fn=spec["forward"],
        )
        results[schedule] = _train(pipe, tokens)
    dist.barrier()
    return results


def _assert_equal_to_one_process(ranks: list[dict[str, Any]], ref: dict[str, Any], schedule: str) -> None:
    for rank in ranks:
        assert rank[schedule]["losses"] == pytest.approx(ref["losses"], rel=1e-5), schedule
    for step in range(STEPS):
        seen: set[str] = set()
        for rank in ranks:
            for name, grad in rank[schedule]["grads"][step].items():
                torch.testing.assert_close(
                    grad,
                    ref["grads"][step][name],
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, n=name: f"{schedule} {n}: {m}",
                )
                seen.add(name)
        assert seen == set(ref["grads"][step]), (schedule, seen ^ set(ref["grads"][step]))


def _assert_layout(
    ranks: list[dict[str, Any]],
    ref: dict[str, Any],
    schedule: str,
    *,
    layers: str,
    tied: tuple[str, str],
    held_as: str,
) -> None:
    """Each rank holds its stages, each stage its own layers; the first and the last stage hold a
    copy of the tied weight (the last as `held_as`), equal to one process's weight after the steps."""
    expected_ranks = _ranks_of(schedule)
    assert [r[schedule]["stage_ids"] for r in ranks] == expected_ranks, schedule
    num_stages = sum(len(s) for s in expected_ranks)
    per_stage = 4 // num_stages
    held = {stage: names for r in ranks for stage, names in r[schedule]["held"].items()}
    pattern = re.compile(rf"^{re.escape(layers)}\.(\d+)\.")
    for stage, params in held.items():
        found = {int(m.group(1)) for n in params if (m := pattern.match(n))}
        assert found == set(range(stage * per_stage, (stage + 1) * per_stage)), (schedule, stage, found)
    first, last = held[0], held[num_stages - 1]
    weight = ref["weights"][tied[0]]
    torch.testing.assert_close(first[tied[0]], weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(last[held_as], weight, rtol=1e-5, atol=1e-6)
    for stage in range(1, num_stages - 1):  # the middle stages hold no copy
        assert tied[0] not in held[stage] and tied[1] not in held[stage], (schedule, stage)
    for r in ranks:  # named_parameters() names every copy as one process does
        assert tied[1] not in r[schedule]["one_process_names"], schedule


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_tie_listed_once_equals_one_process_under_every_schedule(family: str) -> None:
    spec = FAMILIES[family]
    ref = one_process(spec["model"])
    ranks = run_on_ranks(_generic_ranks, world_size=2, args=(family, SCHEDULES, False), timeout_s=TIMEOUT)
    for schedule in SCHEDULES:
        _assert_equal_to_one_process(ranks, ref, schedule)
        # listed once, the last stage holds the head only: its copy is the head's weight, under the
        # head's name (a transformers model split by the package: the embedding too, by its name)
        held_as = spec.get("held_as", spec["tied"][1])
        _assert_layout(ranks, ref, schedule, layers=spec["layers"], tied=spec["tied"], held_as=held_as)


def test_the_tied_module_listed_in_both_stages_still_works() -> None:
    """The earlier rule (the embedding named in the last stage too) is still accepted (nanoGPT: its
    later stages stand in for the embedding, so holding it there changes nothing else)."""
    spec = FAMILIES["nanogpt"]
    ref = one_process(spec["model"])
    # zbv: both copies on one rank (test_nanogpt runs 1f1b and interleaved1f1b)
    schedules = ["zbv" if v_schedules_run_on_gloo() else "looped_bfs"]
    ranks = run_on_ranks(_generic_ranks, world_size=2, args=("nanogpt", schedules, True), timeout_s=TIMEOUT)
    for schedule in schedules:
        _assert_equal_to_one_process(ranks, ref, schedule)
        _assert_layout(
            ranks, ref, schedule, layers=spec["layers"], tied=spec["tied"], held_as=spec["tied"][0]
        )
