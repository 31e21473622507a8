"""What a Hugging Face causal LM does around its decoder layers, read off one traced forward.

A pipeline stage runs the model's own ``forward`` (see `hf_stage.py`), so the split only needs to
know, for the modules that hold parameters outside the decoder layers, whether the model runs
them *before* the layers (embeddings, learned positions, embedding norms: the first stage holds
them) or *after* them (final norm, LM head: the last stage). Registration order cannot tell (OPT
registers its final norm before its layers), so one forward is traced on a parameter-free copy
of the model (meta tensors, torch's fake-tensor mode) and the call order is recorded, together
with how the layers take and return hidden states. The same forward follows values
(`hf_dataflow.SourceTracker`) to find what later layers read besides the hidden states; what a
stage boundary must then carry is decided in `hf_boundary.py`. Nothing here is specific to one family.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from automodel.mesh.model_parts import find_layer_list, input_embeddings, model_text_config, parameter_places
from automodel.pipeline.hf_boundary import (
    INSIDE,
    OUTPUT,
    TOKEN_IDS,
    BoundaryError,
    EntrySpec,
    carried_entries,
    carried_pre_modules,
    check_cross_layer_reads,
    layer_inputs,
    module_reads_of,
    record_containers,
    record_writes,
)
from automodel.pipeline.hf_dataflow import SourceTracker, tensors_in
from automodel.pipeline.meta_fast_path import fast_meta_result

#: Sequence length of the traced forward (any length the model accepts; shapes only).
_TRACE_SEQ = 16


@dataclass(frozen=True)
class HFStructure:
    """The layer list and the roles of the other parameter-holding modules of one model."""

    model_type: str
    #: FQN of the ModuleList of decoder layers, e.g. ``model.layers`` or ``transformer.h``.
    layers_fqn: str
    num_layers: int
    #: Modules with parameters the forward runs before the first layer (held by the first stage).
    pre_fqns: tuple[str, ...]
    #: Those of `pre_fqns` whose outputs the layers read besides the hidden states (RoFormer's
    #: sinusoidal position table): every stage holds and runs them, as one process does.
    shared_pre_fqns: tuple[str, ...]
    #: Modules with parameters the forward runs after the last layer (held by the last stage).
    post_fqns: tuple[str, ...]
    #: Modules with parameters whose ``forward`` never ran (kept on the first stage, as one process would).
    unused_fqns: tuple[str, ...]
    #: Parameter-free modules outside the layers (rotary embeddings, dropout): on every stage.
    stateless_fqns: tuple[str, ...]
    #: Modules holding only weights tied across the layers (input embedding = LM head), whole pre-
    #: or post-modules or submodules of them: the first and the last stage hold them all, so each
    #: sees the tie (and keeps it, e.g. under TP).
    tied_fqns: tuple[str, ...]
    #: 0: a layer returns the hidden states; n > 0: a tuple of n items, hidden states first.
    layer_output_len: int
    #: Keyword under which the model passes hidden states to a layer; None: first positional.
    hidden_kwarg: str | None
    #: Width of the layers' hidden states and of the input embeddings (inputs_embeds).
    hidden_size: int
    embed_size: int
    #: Modules run before the layers whose outputs later layers read besides the hidden states but
    #: later stages cannot compute (they derive from the token ids or the input embeddings): the
    #: first stage hands their outputs over with the hidden states (see `hf_boundary`).
    carried_pre_fqns: tuple[str, ...] = ()
    #: How many tensors each of `carried_pre_fqns` returns.
    carried_pre_tensors: tuple[int, ...] = ()
    #: Per layer b, the entries of a mapping handed to every layer (a key/value cache shared across
    #: layers) that a stage ending before layer b hands over; empty when no layer reads another's.
    carried_entries: tuple[tuple[EntrySpec, ...], ...] = ()

    def entries_at(self, boundary: int) -> tuple[EntrySpec, ...]:
        """The entries carried into layer `boundary` (none at 0 or past the last layer)."""
        return self.carried_entries[boundary] if 0 < boundary < len(self.carried_entries) else ()

    def carried_tensors_at(self, boundary: int) -> int:
        """How many tensors besides the hidden states a stage boundary before layer `boundary` carries."""
        if not 0 < boundary < self.num_layers:
            return 0
        return sum(self.carried_pre_tensors) + sum(e.num_tensors for e in self.entries_at(boundary))


def _outside_modules(model: nn.Module, layers_fqn: str) -> tuple[list[str], list[str], list[str]]:
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


def called_modules(module: nn.Module) -> list[nn.Module]:
    """The modules the model calls for `module`: itself, or for a ModuleList / ModuleDict (which has
    no forward; Gemma 3n's ``altup_projections``) the modules inside it."""
    if isinstance(module, nn.ModuleList | nn.ModuleDict):
        return [m for child in module.children() for m in called_modules(child)]
    return [module]


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy whose parameters and buffers are meta tensors (no data is copied)."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in memo:
            continue
        meta = t.detach().to("meta")
        memo[id(t)] = (
            nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        )
    return copy.deepcopy(module, memo)


class PipelineSplitError(ValueError):
    """The model cannot be split into pipeline stages generically; the message says why."""


def trace_hf_structure(model: nn.Module) -> HFStructure:
    """Trace one forward of a parameter-free copy of `model` and classify its modules.

    Raises `PipelineSplitError` naming the model_type when the model cannot be split generically:
    no layer list, parameters held by a module that runs between layers, a layer output the
    stages cannot pass on, or a forward that cannot run on meta tensors.
    """
    config = model_text_config(model)
    model_type = str(getattr(config, "model_type", type(model).__name__))
    found = find_layer_list(model)
    if found is None:
        raise PipelineSplitError(
            f"model_type {model_type!r}: no ModuleList of decoder layers found; pipelining splits a model by it"
        )
    layers_fqn, layers = found
    with_params, stateless, own_params = _outside_modules(model, layers_fqn)
    if own_params:
        raise PipelineSplitError(
            f"model_type {model_type!r}: {own_params} hold parameters of their own outside any submodule; "
            "a stage cannot tell when the model uses them"
        )

    twin = meta_copy(model)
    # Shapes only: bf16 satisfies kernels whose meta implementations accept nothing else
    # (grouped_mm), and eager attention avoids fused kernels whose meta versions lack features (GQA).
    twin.to(torch.bfloat16)
    _use_eager_attention(twin)
    events: list[tuple[str, str]] = []
    layer_io: dict[str, Any] = {}
    tracker = SourceTracker()
    twin_layers = twin.get_submodule(layers_fqn)
    handles = []
    for fqn in with_params:
        for module in called_modules(twin.get_submodule(fqn)):
            handles.append(
                module.register_forward_pre_hook(lambda m, a, f=fqn: events.append(("outside", f)))
            )
            handles.append(module.register_forward_hook(_outside_post_hook(fqn, layer_io, tracker)))
    for i, layer in enumerate(twin_layers):
        handles.append(
            layer.register_forward_pre_hook(_layer_pre_hook(i, events, layer_io, tracker), with_kwargs=True)
        )
        handles.append(layer.register_forward_hook(_layer_post_hook(i, layer_io, tracker)))
    try:
        _trace_forward(twin, events=events, layer_io=layer_io, tracker=tracker)
    except Exception as err:  # any failure means: cannot be split generically
        raise PipelineSplitError(
            f"model_type {model_type!r}: its forward could not be traced on meta tensors to find what runs "
            f"before and after the decoder layers ({type(err).__name__}: {str(err)[:300]})"
        ) from err
    finally:
        for h in handles:
            h.remove()
    return _classify(
        model,
        model_type=model_type,
        layers_fqn=layers_fqn,
        num_layers=len(layers),
        with_params=with_params,
        stateless=stateless,
        events=events,
        layer_io=layer_io,
    )


def _trace_forward(
    twin: nn.Module, *, events: list, layer_io: dict[str, Any], tracker: SourceTracker
) -> None:
    """One forward of the parameter-free `twin`: on plain meta tensors (cheap: a 70B model's 80
    layers in about half a second), else, for models whose forward needs values meta tensors do
    not have (data-dependent shapes, ``.item()``), under torch's fake-tensor mode (about 50x the
    cost per op). The hooks record into `events` / `layer_io` (and label values in `tracker`,
    entered innermost); a failed attempt's records are dropped.
    """

    def run(**extra: Any) -> None:
        ids = torch.zeros(1, _TRACE_SEQ, dtype=torch.long, device="meta")
        layer_io["input_ids"] = ids  # to recognize layers that read the token ids
        tracker.add([ids], [TOKEN_IDS])  # and modules whose outputs derive from them
        positions = torch.arange(_TRACE_SEQ, device="meta").unsqueeze(0)
        twin(input_ids=ids, position_ids=positions, use_cache=False, **extra)

    try:
        # An all-ones padding mask: without one, transformers inspects the position ids for packed
        # sequences with `.item()`, which meta tensors cannot answer.
        # The fast path answers the commonest pointwise operators (torch's Python meta kernels for
        # them cost most of the trace); the tracker still labels their results.
        tracker.shortcut = fast_meta_result
        with torch.no_grad(), tracker:
            run(attention_mask=torch.ones(1, _TRACE_SEQ, dtype=torch.long, device="meta"))
        return
    except Exception:  # noqa: BLE001 - retried with fake tensors, whose failure is reported
        events.clear()
        layer_io.clear()
        tracker.clear()
    finally:
        tracker.shortcut = None
    from torch._subclasses.fake_tensor import FakeTensorMode

    # A data-dependent shape (an MoE block's loop over the experts that got tokens, found with
    # nonzero) has no fake answer: the trace takes "no tokens routed", which skips work inside a
    # layer only; what runs before, between and after the layers is unchanged.
    tracker.shortcut = _nothing_routed
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), tracker:
            run()
    finally:
        tracker.shortcut = None


def _nothing_routed(func: Any, args: tuple, kwargs: dict) -> Any:
    """``nonzero`` finds nothing: an empty index tensor, for the fake-tensor retry of the trace."""
    if func is torch.ops.aten.nonzero.default:
        return torch.empty((0, args[0].dim()), dtype=torch.long, device=args[0].device)
    return None


def _use_eager_attention(model: nn.Module) -> None:
    configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
    for config in configs.values():
        if hasattr(config, "_attn_implementation"):
            try:
                config._attn_implementation = "eager"
            except (AttributeError, ValueError):
                pass


def _outside_post_hook(fqn: str, layer_io: dict[str, Any], tracker: SourceTracker) -> Any:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        out = tensors_in(output)
        # What its output derives from (other modules'), then the module itself; on the nearest
        # channel, the module alone.
        sources = tracker.sources(out)
        layer_io.setdefault("module_reads", {}).setdefault(fqn, set()).update(sources)
        layer_io.setdefault("module_nearest", {}).setdefault(fqn, set()).update(tracker.nearest(out))
        layer_io.setdefault("module_tensors", {})[fqn] = len(out)
        tracker.replace(out, sources | {fqn}, nearest=[fqn])

    return hook


def _layer_pre_hook(index: int, events: list, layer_io: dict[str, Any], tracker: SourceTracker) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        events.append(("layer", str(index)))
        inputs = layer_inputs(args, kwargs)
        carried = layer_io.get("carried_out", ())  # the previous layer's outputs besides hidden states
        for name, value in inputs.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value is layer_io.get("input_ids"):
                layer_io.setdefault("reads_ids", set()).add(name)
            if any(value is out for out in carried) and name in kwargs and _needs(module, args, kwargs, name):
                layer_io.setdefault("carried", set()).add(name)
        if index == 0 and "hidden_kwarg" not in layer_io:
            if args and isinstance(args[0], torch.Tensor):
                layer_io["hidden_kwarg"], layer_io["hidden_size"] = None, args[0].shape[-1]
            elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
                layer_io["hidden_kwarg"], layer_io["hidden_size"] = (
                    "hidden_states",
                    kwargs["hidden_states"].shape[-1],
                )
        record_containers(index, args, kwargs, layer_io)
        tracker.inside = f"{INSIDE}{index}"  # until its post hook: what it computes is its own

    return hook


def _needs(layer: nn.Module, args: tuple, kwargs: dict, name: str) -> bool:
    """Whether `layer` fails without the value the previous layer handed it as `name` (what the
    first layer of a later stage gets). Some layers recompute it (a full indexer layer) and run."""
    try:
        layer.forward(*args, **{**kwargs, name: None})
    except Exception:
        return True
    return False


def _layer_post_hook(index: int, layer_io: dict[str, Any], tracker: SourceTracker) -> Any:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        out = tensors_in(output)
        if index > 0:
            # The previous layer's outputs carry no labels (reset below), so what this one's derive
            # from is what it (or the model between layers) read besides the hidden states. Layer 0
            # always runs on the first stage, which holds every pre-layer module.
            layer_io.setdefault("layer_reads", set()).update(tracker.sources(out))
        # Its nearest sources: the modules before the layers, its hidden input (the previous layer's
        # output) and anything else an earlier layer computed that it reads (see `hf_boundary`).
        layer_io.setdefault("layer_nearest", {})[index] = tracker.nearest(out)
        tracker.replace(out, (), nearest=[f"{OUTPUT}{index}"])
        tracker.inside = None
        record_writes(index, layer_io, tracker)
        extra = output[1:] if isinstance(output, tuple) else ()
        layer_io["carried_out"] = tuple(t for t in extra if isinstance(t, torch.Tensor))
        if isinstance(output, torch.Tensor):
            layer_io.setdefault("outputs", set()).add(0)
        elif isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            layer_io.setdefault("outputs", set()).add(len(output))
        else:
            layer_io.setdefault("outputs", set()).add(-1)

    return hook


def _classify(
    model: nn.Module,
    *,
    model_type: str,
    layers_fqn: str,
    num_layers: int,
    with_params: list[str],
    stateless: list[str],
    events: list[tuple[str, str]],
    layer_io: dict[str, Any],
) -> HFStructure:
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
    # In the order the forward runs them (registration order can differ).
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
    outputs = layer_io.get("outputs", set())
    if len(outputs) != 1 or -1 in outputs or "hidden_kwarg" not in layer_io:
        raise PipelineSplitError(
            f"model_type {model_type!r}: its decoder layers do not take and return hidden states in one "
            "way (a tensor, or a tuple with the hidden states first), so stages cannot pass them on"
        )
    if layer_io.get("carried"):
        # A stage boundary carries the hidden states only: the first layer of a later stage would
        # get nothing for what the previous layer handed it.
        raise PipelineSplitError(
            f"model_type {model_type!r}: its decoder layers pass more than hidden states to the next layer "
            f"(some layers cannot run without the {sorted(layer_io['carried'])} the previous layer returns), "
            "which a pipeline stage boundary does not carry"
        )
    if layer_io.get("reads_ids"):
        # Later stages receive hidden states, not the token ids (e.g. hash-routed experts read them).
        raise PipelineSplitError(
            f"model_type {model_type!r}: its decoder layers read the token ids ({sorted(layer_io['reads_ids'])}), "
            "which later pipeline stages do not receive"
        )
    embed_size = _input_embedding_size(model) or layer_io["hidden_size"]
    calls = {fqn: len(steps) for fqn, steps in steps_of.items()}
    try:
        shared, carried = _pre_modules_read_by_layers(
            model, pre, post, layer_io, num_layers=num_layers, calls=calls, model_type=model_type
        )
        read_entries = check_cross_layer_reads(
            layer_io, num_layers=num_layers, post=post, model_type=model_type
        )
        entries = carried_entries(
            layer_io, num_layers=num_layers, read_entries=read_entries, model_type=model_type
        )
    except BoundaryError as err:
        raise PipelineSplitError(str(err)) from None
    return HFStructure(
        model_type=model_type,
        layers_fqn=layers_fqn,
        num_layers=num_layers,
        pre_fqns=tuple(pre),
        shared_pre_fqns=tuple(shared),
        post_fqns=tuple(post),
        unused_fqns=tuple(unused),
        stateless_fqns=tuple(stateless),
        tied_fqns=tuple(_tied_modules(model, pre, post, model_type=model_type)),
        layer_output_len=next(iter(outputs)),
        hidden_kwarg=layer_io["hidden_kwarg"],
        hidden_size=int(layer_io["hidden_size"]),
        embed_size=int(embed_size),
        carried_pre_fqns=tuple(carried),
        carried_pre_tensors=tuple(layer_io["module_tensors"][f] for f in carried),
        carried_entries=entries,
    )


def _pre_modules_read_by_layers(
    model: nn.Module,
    pre: list[str],
    post: list[str],
    layer_io: dict[str, Any],
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
    reads = layer_io.get("module_reads", {})
    shared = (set(layer_io.get("layer_reads", set())) | module_reads_of(layer_io, post)) & set(pre)
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
        layer_io, pre=pre, post=post, num_layers=num_layers, calls=calls, model_type=model_type
    )
    containers = [f for f in carried if isinstance(model.get_submodule(f), nn.ModuleList | nn.ModuleDict)]
    if containers:
        raise PipelineSplitError(
            f"model_type {model_type!r}: its later layers read the outputs of the modules inside {containers} "
            "besides the hidden states; pipeline stages hand over outputs of whole modules only"
        )
    return [], carried


def _input_embedding_size(model: nn.Module) -> int | None:
    weight = getattr(input_embeddings(model), "weight", None)
    return None if weight is None else int(weight.shape[-1])


def _tied_modules(model: nn.Module, pre: list[str], post: list[str], *, model_type: str) -> list[str]:
    """The largest modules inside the pre- and post-modules whose parameters are all shared between
    the two sides: a whole module (Llama's embed_tokens, lm_head) or, where the module also holds
    weights of its own, a submodule of it (BERT's word embeddings inside ``bert.embeddings``).

    The last stage holds the pre-side ones next to the head, so its copy of a tied weight has the
    name it has in one process (initialization seeds and checkpoint keys go by that name).
    """
    tied = {
        pid
        for pid, places in parameter_places(model).items()
        if any(is_within(m, pre) for m, _ in places) and any(is_within(m, post) for m, _ in places)
    }
    found: list[str] = []

    def visit(fqn: str, module: nn.Module) -> None:
        ids = {id(p) for p in module.parameters()}
        if ids and ids <= tied:
            found.append(fqn)
        elif ids & tied:
            for name, child in module.named_children():
                visit(f"{fqn}.{name}", child)

    for fqn in (*pre, *post):
        visit(fqn, model.get_submodule(fqn))
    covered = {id(p) for f in found if is_within(f, pre) for p in model.get_submodule(f).parameters()}
    loose = [n for n, p in model.named_parameters() if id(p) in tied and id(p) not in covered]
    if loose:
        # Rule: a tied weight must sit in a module of its own on the input side, which the last
        # stage can hold under the weight's one-process name.
        raise PipelineSplitError(
            f"model_type {model_type!r}: the weights {loose} are tied between the modules run before and "
            "after the decoder layers but held directly by a module with other weights, so the last "
            "pipeline stage cannot hold its copy under the same name; build it with tie_word_embeddings=False"
        )
    named_first = {}  # the name one process gives each weight (its first)
    for name, p in model.named_parameters():
        named_first.setdefault(id(p), name)
    outside = [
        named_first[i] for i in sorted(tied) if not any(named_first[i].startswith(f + ".") for f in found)
    ]
    if outside:
        # Rule: one process names a tied weight by its first place in the model; both the first
        # and the last stage must hold the module of that place, or their copies' names differ.
        raise PipelineSplitError(
            f"model_type {model_type!r}: its tied weights {outside} are named in one process after a place "
            "(the head, registered before the embeddings) that no stage but the last can hold, so the "
            "stages' copies would be initialized and loaded under different names; build it with "
            "tie_word_embeddings=False"
        )
    return found


def is_within(fqn: str, roots: list[str] | tuple[str, ...]) -> bool:
    """Whether `fqn` is one of `roots` or a submodule of one."""
    return any(fqn == r or fqn.startswith(r + ".") for r in roots)
