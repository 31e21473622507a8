"""Classify the modules around a model's decoder layers from one traced forward (`hf_trace`).

Before the layers (the first stage holds them), after them (the last stage), never run, or
between them (refused: no single stage could hold them); whether the layers take and return
hidden states in one way; which pre-layer outputs every stage recomputes or the first hands over.
"""

from __future__ import annotations

from torch import nn

from automodel.mesh.model_parts import input_embeddings
from automodel.pipeline.hf_boundary import TOKEN_IDS, carried_pre_modules, module_reads_of
from automodel.pipeline.hf_trace import LayerIO
from automodel.pipeline.split import PipelineSplitError


def outside_modules(model: nn.Module, layers_fqn: str) -> tuple[list[str], list[str], list[str]]:
    """Children of the ancestors of the layer list, off the path to it: (with params, without params,
    ancestors that hold parameters of their own)."""
    with_params, stateless, own_params = [], [], []
    path = layers_fqn.split(".")
    node, prefix = model, ""
    for atom in path:
        if any(True for _ in node.parameters(recurse=False)):
            own_params.append(prefix or "<root>")
        for name, child in node.named_children():
            if name == atom or child is None:
                continue
            fqn = f"{prefix}{name}"
            (with_params if any(True for _ in child.parameters()) else stateless).append(fqn)
        node = getattr(node, atom)
        prefix = f"{prefix}{atom}."
    return with_params, stateless, own_params


def order_outside_modules(
    events: list[tuple[str, str]], *, with_params: list[str], num_layers: int, model_type: str
) -> tuple[list[str], list[str], list[str], dict[str, int]]:
    """(pre, post, unused) modules in the order the forward runs them (registration order can
    differ), and how often each ran; `PipelineSplitError` for one run between the layers."""
    layer_steps = [i for i, (kind, _) in enumerate(events) if kind == "layer"]
    called = {name for kind, name in events if kind == "layer"}
    if len(called) != num_layers:
        raise PipelineSplitError(
            f"model_type {model_type!r}: the traced forward ran {len(called)} of its {num_layers} decoder layers"
        )
    first, last = layer_steps[0], layer_steps[-1]
    pre, post, unused, interleaved = [], [], [], []
    steps_of = {
        fqn: [i for i, (kind, name) in enumerate(events) if kind == "outside" and name == fqn]
        for fqn in with_params
    }
    for fqn in sorted(with_params, key=lambda f: steps_of[f][0] if steps_of[f] else len(events)):
        steps = steps_of[fqn]
        if not steps:
            unused.append(fqn)
        elif any(first < s < last for s in steps) or (
            any(s < first for s in steps) and any(s > last for s in steps)
        ):
            interleaved.append(fqn)
        elif steps[0] < first:
            pre.append(fqn)
        else:
            post.append(fqn)
    if interleaved:
        raise PipelineSplitError(
            f"model_type {model_type!r}: {interleaved} run between (or both before and after) the decoder layers, "
            "so no single pipeline stage can hold them"
        )
    return pre, post, unused, {fqn: len(steps) for fqn, steps in steps_of.items()}


def check_layer_io(io: LayerIO, *, model_type: str) -> None:
    """Rule: stages pass the hidden states on, and only them: a layer must take and return them in
    one way and must not need the token ids or other outputs of the previous layer."""
    if len(io.outputs) != 1 or -1 in io.outputs or io.hidden_size is None:
        raise PipelineSplitError(
            f"model_type {model_type!r}: its decoder layers do not take and return hidden states in one "
            "way (a tensor, or a tuple with the hidden states first), so stages cannot pass them on"
        )
    if io.carried:
        # A stage boundary carries the hidden states only: the first layer of a later stage would
        # get nothing for what the previous layer handed it.
        raise PipelineSplitError(
            f"model_type {model_type!r}: its decoder layers pass more than hidden states to the next layer "
            f"(some layers cannot run without the {sorted(io.carried)} the previous layer returns), "
            "which a pipeline stage boundary does not carry"
        )
    if io.reads_ids:
        # Later stages receive hidden states, not the token ids (e.g. hash-routed experts read them).
        raise PipelineSplitError(
            f"model_type {model_type!r}: its decoder layers read the token ids ({sorted(io.reads_ids)}), "
            "which later pipeline stages do not receive"
        )


def pre_modules_read_by_layers(
    model: nn.Module,
    pre: list[str],
    post: list[str],
    io: LayerIO,
    *,
    num_layers: int,
    calls: dict[str, int],
    model_type: str,
) -> tuple[list[str], list[str]]:
    """(pre-layer modules every stage runs, pre-layer modules whose outputs the first stage hands
    over), for the pre-layer values later layers and post-layer modules read besides the hidden
    states (in the order the forward runs them).

    Those read values, and the pre-layer modules they derive from, are run again by every stage
    when no later stage lacks their inputs (RoFormer's sinusoidal position table, made from
    shapes). Values deriving from the token ids or the input embeddings are not computable there
    (later stages start from the received hidden states), so the first stage hands them over instead.
    """
    reads = io.module_reads
    shared = (set(io.layer_reads) | module_reads_of(io, post)) & set(pre)
    grown = True
    while grown:
        more = {f for s in shared for f in reads.get(s, set()) if f in pre} - shared
        shared |= more
        grown = bool(more)
    embedding = input_embeddings(model)
    from_input = [
        f
        for f in shared
        if TOKEN_IDS in reads.get(f, set()) or any(m is embedding for m in model.get_submodule(f).modules())
    ]
    if not from_input:
        return [f for f in pre if f in shared], []
    carried = carried_pre_modules(
        io, pre=pre, post=post, num_layers=num_layers, calls=calls, model_type=model_type
    )
    containers = [f for f in carried if isinstance(model.get_submodule(f), nn.ModuleList | nn.ModuleDict)]
    if containers:
        raise PipelineSplitError(
            f"model_type {model_type!r}: its later layers read the outputs of the modules inside {containers} "
            "besides the hidden states; pipeline stages hand over outputs of whole modules only"
        )
    return [], carried


def input_embedding_size(model: nn.Module) -> int | None:
    weight = getattr(input_embeddings(model), "weight", None)
    return None if weight is None else int(weight.shape[-1])
