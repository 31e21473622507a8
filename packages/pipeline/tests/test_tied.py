"""Tied weights across stages: where each stage holds its copy, ranks that disagree on their copies
fail together, never hang; a refusal gives the fix for the kind of model (transformers' config key,
or plain torch).

A rank that misses its copy of a tied weight (its stage knows the weight by another name) once
skipped the shape check's collective while its peer waited in it, and the run hung. The check is
now one gather over the world, so every rank raises the same error.
"""

from __future__ import annotations

import torch
from torch import nn

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline.hf import renamed_tied_modules, tied_parameter_names, tied_parameter_places
from automodel.pipeline.split import check_parameter_coverage
from automodel.pipeline.tied import TiedParameters
from automodel.testing.ranks import run_on_ranks
from automodel.testing.tiny_model import tiny_llama


class _Stage(nn.Module):
    def __init__(self, stage_index: int, attr: str) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.add_module(attr, nn.Linear(4, 8, bias=False))


def _build(first_attr: str, last_attr: str) -> str:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    me = mesh.get_mesh("pp").get_local_rank()
    part = _Stage(me, first_attr if me == 0 else last_attr)
    try:
        tied = TiedParameters.build(
            mesh=mesh,
            holders={"embed.weight": [0, 1]},
            stage_ids_per_rank={0: [0], 1: [1]},
            model_parts=[part],
        )
    except ValueError as err:
        return f"ValueError: {err}"
    weight = part.get_parameter(f"{first_attr if me == 0 else last_attr}.weight")
    weight.grad = torch.full((8, 4), me + 1.0)
    tied.sync_gradients()
    return f"ok {tied.names} {weight.grad[0, 0]}"


def test_matching_copies_sum_gradients() -> None:
    results = run_on_ranks(_build, world_size=2, args=("embed", "embed"), timeout_s=60)
    assert results == ["ok ['embed.weight'] 3.0"] * 2


def test_a_missing_copy_fails_on_every_rank() -> None:
    # The last stage holds the weight as head.weight, not embed.weight: both ranks raise.
    results = run_on_ranks(_build, world_size=2, args=("embed", "head"), timeout_s=60)
    for result in results:
        assert result.startswith(
            "ValueError: rank 1 runs a pipeline stage holding the tied weight embed.weight"
        )


# ---- the refusal says how to fix it, in the model's own terms ------------------------------------
class _TiedLM(nn.Module):
    """Not a transformers model: its tied head is `output`, its embedding `tok_embeddings`."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.output = nn.Linear(8, 32, bias=False)
        self.output.weight = self.tok_embeddings.weight


def test_a_stage_holding_only_the_head_knows_the_tie_by_the_head_name() -> None:
    """Listed once where each sits (embedding on stage 0, head on stage 1): accepted; the last stage
    holds the weight as ``output.weight`` and the split gives it a copy of its own (the ``output``
    module is copied); listed in both stages, both know it by its one-process name."""
    model = _TiedLM()
    fqns = [["tok_embeddings", "layers.0"], ["layers.1", "output"]]
    places = tied_parameter_places(model, fqns)
    assert places == {"tok_embeddings.weight": {0: "tok_embeddings.weight", 1: "output.weight"}}
    assert tied_parameter_names(model, fqns) == {"tok_embeddings.weight": [0, 1]}
    assert renamed_tied_modules(places, fqns) == {1: {"output"}}
    check_parameter_coverage(model, fqns, shared_ok=tied_parameter_names(model, fqns))
    both = [fqns[0], [*fqns[1], "tok_embeddings"]]
    assert tied_parameter_places(model, both) == {
        "tok_embeddings.weight": {0: "tok_embeddings.weight", 1: "tok_embeddings.weight"}
    }
    assert renamed_tied_modules(tied_parameter_places(model, both), both) == {}
    model.output.weight = nn.Parameter(model.output.weight.detach().clone())  # untied: nothing shared
    assert tied_parameter_names(model, fqns) == {}
    check_parameter_coverage(model, fqns)


def test_a_transformers_model_listed_once_is_accepted() -> None:
    model = tiny_llama(layers=2)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    fqns = [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]]
    assert tied_parameter_places(model, fqns) == {
        "model.embed_tokens.weight": {0: "model.embed_tokens.weight", 1: "lm_head.weight"}
    }


def _differently_shaped(hf_model: bool) -> str:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    me = mesh.get_mesh("pp").get_local_rank()
    part = _Stage(me, "embed")
    if me == 1:
        part.embed = nn.Linear(4, 4, bias=False)  # another local shape than stage 0's copy
    try:
        TiedParameters.build(
            mesh=mesh,
            holders={"embed.weight": [0, 1]},
            stage_ids_per_rank={0: [0], 1: [1]},
            model_parts=[part],
            hf_model=hf_model,
        )
    except ValueError as err:
        return str(err)
    return "no error"


def test_copies_shaped_differently_are_told_the_fix_for_their_kind_of_model() -> None:
    generic, hf = (
        run_on_ranks(_differently_shaped, world_size=2, args=(kind,), timeout_s=60) for kind in (False, True)
    )
    for message in generic:
        assert "shard it differently ([(4, 4), (8, 4)] local shapes)" in message, message
        assert message.endswith(
            "`model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())`"
        )
        assert "tie_word_embeddings" not in message
    for message in hf:
        assert message.endswith("or build the model with tie_word_embeddings=False"), message
