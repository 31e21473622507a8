"""Hugging Face decoder-only causal LMs: what can be pipelined, stage FQNs, stage modules.

transformers itself is never imported here: the model's own classes and forward do the work.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from torch import nn

from automodel.mesh.model_parts import find_layer_list, output_embeddings, parameter_places
from automodel.pipeline.hf_stage import CausalLMStage
from automodel.pipeline.hf_structure import (
    HFStructure,
    PipelineSplitError,
    is_within,
    meta_copy,
    trace_hf_structure,
)
from automodel.pipeline.layout import split_layers_evenly
from automodel.pipeline.split import split_module


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Looks like ``XxxForCausalLM``: a ``config``, a list of decoder layers, output embeddings."""
    if getattr(model, "config", None) is None or find_layer_list(model) is None:
        return False
    return output_embeddings(model) is not None


def validate_hf_model_for_pipeline_support(model: nn.Module) -> HFStructure:
    """The model's structure, or `PipelineSplitError` (a ValueError) naming the model_type and why
    it cannot be split: encoder-decoder, no layer list or LM head, or a forward whose modules do
    not sit cleanly before or after the decoder layers (see `trace_hf_structure`)."""
    config = getattr(model, "config", None)
    cls = type(model).__name__
    if config is None:
        raise PipelineSplitError(
            f"{cls} has no .config; not a Hugging Face model (pass module_fqns_per_model_part)"
        )
    model_type = getattr(config, "model_type", cls)
    if getattr(config, "is_encoder_decoder", False):
        raise PipelineSplitError(
            f"model_type {model_type!r} is an encoder-decoder model (config.is_encoder_decoder=True); only "
            "decoder-only causal LMs can be pipelined"
        )
    if find_layer_list(model) is None:
        raise PipelineSplitError(
            f"model_type {model_type!r} ({cls}) has no ModuleList of decoder layers; pipelining splits models by it"
        )
    if not is_hf_causal_lm(model):
        raise PipelineSplitError(
            f"model_type {model_type!r} ({cls}) has no LM head (get_output_embeddings()); pipelining supports "
            "causal LMs (XxxForCausalLM)"
        )
    structure = trace_hf_structure(model)  # its refusals name the structural cause first
    if "inputs_embeds" not in inspect.signature(type(model).forward).parameters:
        # Later stages run the model's own forward from the hidden states they receive, passed as
        # inputs_embeds; a forward that only reads token ids cannot start mid-model.
        raise PipelineSplitError(
            f"model_type {model_type!r} ({cls}): its forward takes no inputs_embeds, so a later pipeline "
            "stage cannot run it on the hidden states it receives"
        )
    return structure


def hf_num_layers(model: nn.Module) -> int:
    found = find_layer_list(model)
    assert found is not None, "validate_hf_model_for_pipeline_support runs first"
    return len(found[1])


def hf_module_fqns_per_stage(
    model: nn.Module, *, num_stages: int, structure: HFStructure | None = None
) -> list[list[str]]:
    """Modules run before the layers on the first stage, those run after on the last (the first and
    the last stage both hold an input embedding tied to the head), parameter-free ones (rotary embeddings)
    and those whose outputs the layers read besides the hidden states (sinusoidal position tables) on
    every stage, decoder layers spread evenly (the remainder one each on the first stages)."""
    structure = structure or validate_hf_model_for_pipeline_support(model)
    ranges = split_layers_evenly(structure.num_layers, num_stages)
    parts: list[list[str]] = []
    for stage, layer_range in enumerate(ranges):
        fqns: list[str] = []
        first, last = stage == 0, stage == num_stages - 1
        if first:
            fqns += [*structure.pre_fqns, *structure.unused_fqns]
        else:
            fqns += list(structure.shared_pre_fqns)
        if last and not first:
            fqns += [
                f
                for f in structure.tied_fqns
                if is_within(f, structure.pre_fqns) and not is_within(f, structure.shared_pre_fqns)
            ]
        fqns += [f"{structure.layers_fqn}.{i}" for i in layer_range]
        if last:
            fqns += list(structure.post_fqns)
        elif first:
            fqns += [f for f in structure.tied_fqns if is_within(f, structure.post_fqns)]
        fqns += list(structure.stateless_fqns)
        parts.append(fqns)
    return parts


@dataclass(frozen=True)
class MetaStandIns:
    """Meta copies of a model's pre-layer modules (by FQN) and of each decoder layer (by index)."""

    pre_modules: dict[str, nn.Module]
    layers: dict[int, nn.Module]


def meta_stand_ins(model: nn.Module, *, structure: HFStructure) -> MetaStandIns:
    """Meta copies of everything a stage may stand in for; take them before parallelizing."""
    layers = cast(nn.ModuleList, model.get_submodule(structure.layers_fqn))  # found by find_layer_list
    return MetaStandIns(
        pre_modules={f: meta_copy(model.get_submodule(f)) for f in structure.pre_fqns},
        layers={i: meta_copy(layers[i]) for i in range(structure.num_layers)},
    )


def make_causal_lm_stage(
    pruned: nn.Module,
    *,
    model: nn.Module,
    structure: HFStructure,
    stage_index: int,
    num_stages: int,
    stand_ins: MetaStandIns | None = None,
) -> CausalLMStage:
    """Wrap a pruned copy of `model` (see `split_module`) as the `CausalLMStage` `stage_index`.

    Later stages get shape-only stand-ins (meta copies) of the modules that run before the layers;
    the placeholders of the layers a stage does not hold answer attribute reads from meta copies.
    A caller building several stages of one rank passes `stand_ins` made before any stage is
    parallelized (a parallelized module, e.g. FSDP-wrapped, cannot be copied).
    """
    ranges = split_layers_evenly(structure.num_layers, num_stages)
    stand_ins = stand_ins if stand_ins is not None else meta_stand_ins(model, structure=structure)
    # Later stages run the shared pre-layer modules themselves; the others get shape-only stand-ins.
    meta_modules = (
        {}
        if stage_index == 0
        else {f: m for f, m in stand_ins.pre_modules.items() if f not in structure.shared_pre_fqns}
    )
    held = ranges[stage_index]
    meta_layers = {i: layer for i, layer in stand_ins.layers.items() if i not in held}
    return CausalLMStage(
        pruned,
        structure=structure,
        stage_index=stage_index,
        num_stages=num_stages,
        layer_range=ranges[stage_index],
        meta_modules=meta_modules,
        meta_layers=meta_layers,
    )


def tied_parameter_places(
    model: nn.Module, fqns_per_stage: Sequence[Sequence[str]]
) -> dict[str, dict[int, str]]:
    """Parameters held by more than one stage (tied weights, the weights of pre-layer modules every
    stage runs), by their name in `model`: the name each holding stage knows it by, per stage id.

    Found by identity in the whole model, so every rank gets the same answer. A stage holds a tied
    weight under its one-process name (its first place: ``emb.weight``) when it holds that module,
    else under the place it holds (``head.weight``, which is also a key of the one-process
    ``state_dict``); the pipeline then gives that stage a copy of its own (`renamed_tied_modules`)
    and pairs the copies by these names.
    """
    owners = {pid: [m for m, _ in where] for pid, where in parameter_places(model).items()}
    holders: dict[str, list[int]] = {}
    for name, param in model.named_parameters():
        stages = [
            s
            for s, fqns in enumerate(fqns_per_stage)
            if any(o == f or o.startswith(f + ".") for f in fqns for o in owners[id(param)])
        ]
        if len(stages) > 1:
            holders[name] = stages
    places: dict[str, dict[int, str]] = {}
    for name, stages in holders.items():
        for s in stages:
            pruned = split_module(model, fqns=fqns_per_stage[s])  # shares modules: ids are the model's
            held_as = {id(p): n for n, p in pruned.named_parameters()}
            got = held_as.get(id(model.get_parameter(name)))
            assert got is not None, f"stage {s} holds a module of {name} but not the weight"
            places.setdefault(name, {})[s] = got
    return places


def tied_parameter_names(model: nn.Module, fqns_per_stage: Sequence[Sequence[str]]) -> dict[str, list[int]]:
    """Parameters held by more than one stage, by their name in `model`: the stage ids holding them."""
    return {name: sorted(by_stage) for name, by_stage in tied_parameter_places(model, fqns_per_stage).items()}


def renamed_tied_modules(
    places: dict[str, dict[int, str]], fqns_per_stage: Sequence[Sequence[str]]
) -> dict[int, set[str]]:
    """Per stage, the listed modules that hold a tied weight under another name than its one-process
    one (the head of a model whose head weight is its embedding's, listed only on the last stage):
    the split copies them, so that stage's copy is a parameter of its own (two stages of one rank,
    as in a V schedule, must not share one object) whose gradient `TiedParameters` sums with the others'."""
    found: dict[int, set[str]] = {}
    for name, by_stage in places.items():
        for stage, held_as in by_stage.items():
            if held_as == name:
                continue
            module = held_as.rpartition(".")[0]
            found.setdefault(stage, set()).update(
                f for f in fqns_per_stage[stage] if module == f or module.startswith(f + ".")
            )
    return found
