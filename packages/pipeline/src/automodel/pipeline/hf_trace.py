"""One traced forward of a parameter-free copy of a Hugging Face model, recorded for the split.

A copy with meta parameters (`meta_copy`) runs the model's own ``forward`` once; hooks on the
modules outside the decoder layers and on each layer record the call order (``events``) and, in a
`LayerIO`, how the layers take and return hidden states and which values (labelled by
`hf_dataflow.SourceTracker`) each layer and module reads. `hf_structure.trace_hf_structure`
classifies the modules from that record; `hf_boundary` decides what a stage boundary carries.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from automodel.pipeline.hf_boundary import (
    INSIDE,
    OUTPUT,
    TOKEN_IDS,
    layer_inputs,
    record_containers,
    record_writes,
)
from automodel.pipeline.hf_dataflow import SourceTracker, tensors_in
from automodel.pipeline.hf_values import KnownValues
from automodel.pipeline.meta_fast_path import fast_meta_result
from automodel.pipeline.torch_internals import FakeTensorMode

#: Sequence length of the traced forward (any length the model accepts; shapes only).
TRACE_SEQ = 16


@dataclass
class LayerIO:
    """What the traced forward's hooks record about the layers and the modules around them."""

    #: The token ids the trace fed (to recognize layers that read them).
    input_ids: torch.Tensor | None = None
    #: Keyword under which the model passes hidden states to a layer (None: first positional) and
    #: their width; `hidden_size` stays None until layer 0 shows one of the two ways.
    hidden_kwarg: str | None = None
    hidden_size: int | None = None
    #: Per layer call, how its output looks: 0 a tensor, n a tuple of n (hidden states first), -1 neither.
    outputs: set[int] = field(default_factory=set)
    #: Inputs by which layers read the token ids.
    reads_ids: set[str] = field(default_factory=set)
    #: Inputs a layer needs that the previous layer returned besides the hidden states.
    carried: set[str] = field(default_factory=set)
    #: The tensors the last layer returned besides the hidden states.
    carried_out: tuple[torch.Tensor, ...] = ()
    #: What the outputs of the layers after the first derive from besides their hidden input.
    layer_reads: set[str] = field(default_factory=set)
    #: Per layer, the nearest labels of what its outputs derive from.
    layer_nearest: dict[int, set[str]] = field(default_factory=dict)
    #: Per outside module: the labels its outputs derive from, the nearest ones, how many tensors it returns.
    module_reads: dict[str, set[str]] = field(default_factory=dict)
    module_nearest: dict[str, set[str]] = field(default_factory=dict)
    module_tensors: dict[str, int] = field(default_factory=dict)
    #: Per layer, the mappings it is handed: (location, mapping, tensor ids per key, leaves per key).
    containers: dict[int, list[tuple[str, Any, dict, dict]]] = field(default_factory=dict)
    #: Per layer, the (location, key) entries it wrote into those mappings.
    writes: dict[int, set[tuple[str, Hashable]]] = field(default_factory=dict)

    def clear(self) -> None:
        """Forget everything (a failed trace attempt's records)."""
        fresh = LayerIO()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))


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


#: Attention implementations the trace runs as the model does (their kernels have meta versions).
TRACEABLE_ATTENTION = ("eager", "sdpa")


def use_traceable_attention(model: nn.Module) -> None:
    """Keep the model's attention where it is eager or sdpa (the trace runs what training runs); an
    implementation of its own kernels (flash_attention_2, a hub kernel, flex) has no meta version, so
    the trace runs sdpa instead, which takes the same inputs (no mask when there is no padding,
    key/value heads as they are)."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    for config in configs.values():
        if getattr(config, "_attn_implementation", None) in (None, *TRACEABLE_ATTENTION):
            continue
        try:
            config._attn_implementation = "sdpa"
        except (AttributeError, ValueError):
            pass


def trace_layer_io(
    model: nn.Module, *, layers_fqn: str, with_params: list[str]
) -> tuple[list[tuple[str, str]], LayerIO]:
    """Run one forward of a meta copy of `model`: the call order (("outside", fqn) for the modules
    `with_params`, ("layer", index) for the decoder layers) and what the hooks recorded. Any
    exception of the model's forward propagates (the caller says the model cannot be split)."""
    twin = meta_copy(model)
    # Shapes only: bf16 satisfies kernels whose meta implementations accept nothing else (grouped_mm).
    twin.to(torch.bfloat16)
    use_traceable_attention(twin)
    events: list[tuple[str, str]] = []
    io = LayerIO()
    tracker = SourceTracker()
    handles = []
    for fqn in with_params:
        for module in called_modules(twin.get_submodule(fqn)):
            handles.append(
                module.register_forward_pre_hook(lambda m, a, f=fqn: events.append(("outside", f)))
            )
            handles.append(module.register_forward_hook(_outside_post_hook(fqn, io, tracker)))
    for i, layer in enumerate(twin.get_submodule(layers_fqn)):
        handles.append(
            layer.register_forward_pre_hook(_layer_pre_hook(i, events, io, tracker), with_kwargs=True)
        )
        handles.append(layer.register_forward_hook(_layer_post_hook(i, io, tracker)))
    try:
        _trace_forward(twin, events=events, io=io, tracker=tracker)
    finally:
        for h in handles:
            h.remove()
    return events, io


def _trace_forward(twin: nn.Module, *, events: list, io: LayerIO, tracker: SourceTracker) -> None:
    """One forward of the parameter-free `twin`, called as a pipeline stage calls it (token ids,
    position ids ``0..n-1``, no attention mask): on plain meta tensors (cheap: a 70B model's 80
    layers in about half a second), whose values the trace knows where they follow from its inputs
    alone (`hf_values.KnownValues`: transformers reads the position ids for packed sequences and
    then, as in the run, hands sdpa no mask), else, for models whose forward needs values meta
    tensors do not have (data-dependent shapes), under torch's fake-tensor mode (about 50x the
    cost per op). The hooks record into `events` / `io` (and label values in `tracker`, entered
    inside the fake mode); a failed attempt's records are dropped.
    """

    def run() -> None:
        ids = torch.zeros(1, TRACE_SEQ, dtype=torch.long, device="meta")
        io.input_ids = ids  # to recognize layers that read the token ids
        tracker.add([ids], [TOKEN_IDS])  # and modules whose outputs derive from them
        positions = torch.arange(TRACE_SEQ, device="meta").unsqueeze(0)
        twin(input_ids=ids, position_ids=positions, use_cache=False)

    try:
        # The fast path answers the commonest pointwise operators (torch's Python meta kernels for
        # them cost most of the trace); the tracker still labels their results.
        tracker.shortcut = fast_meta_result
        with torch.no_grad(), tracker, KnownValues():
            run()
        return
    except Exception:  # noqa: BLE001 - retried with fake tensors, whose failure is reported
        events.clear()
        io.clear()
        tracker.clear()
    finally:
        tracker.shortcut = None

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


def _outside_post_hook(fqn: str, io: LayerIO, tracker: SourceTracker) -> Any:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        out = tensors_in(output)
        # What its output derives from (other modules'), then the module itself; on the nearest
        # channel, the module alone.
        sources = tracker.sources(out)
        io.module_reads.setdefault(fqn, set()).update(sources)
        io.module_nearest.setdefault(fqn, set()).update(tracker.nearest(out))
        io.module_tensors[fqn] = len(out)
        tracker.replace(out, sources | {fqn}, nearest=[fqn])

    return hook


def _layer_pre_hook(index: int, events: list, io: LayerIO, tracker: SourceTracker) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        events.append(("layer", str(index)))
        inputs = layer_inputs(args, kwargs)
        carried = io.carried_out  # the previous layer's outputs besides hidden states
        for name, value in inputs.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value is io.input_ids:
                io.reads_ids.add(name)
            if any(value is out for out in carried) and name in kwargs and _needs(module, args, kwargs, name):
                io.carried.add(name)
        if index == 0 and io.hidden_size is None:
            if args and isinstance(args[0], torch.Tensor):
                io.hidden_kwarg, io.hidden_size = None, int(args[0].shape[-1])
            elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
                io.hidden_kwarg, io.hidden_size = "hidden_states", int(kwargs["hidden_states"].shape[-1])
        record_containers(index, args, kwargs, io)
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


def _layer_post_hook(index: int, io: LayerIO, tracker: SourceTracker) -> Any:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        out = tensors_in(output)
        if index > 0:
            # The previous layer's outputs carry no labels (reset below), so what this one's derive
            # from is what it (or the model between layers) read besides the hidden states. Layer 0
            # always runs on the first stage, which holds every pre-layer module.
            io.layer_reads.update(tracker.sources(out))
        # Its nearest sources: the modules before the layers, its hidden input (the previous layer's
        # output) and anything else an earlier layer computed that it reads (see `hf_boundary`).
        io.layer_nearest[index] = tracker.nearest(out)
        tracker.replace(out, (), nearest=[f"{OUTPUT}{index}"])
        tracker.inside = None
        record_writes(index, io, tracker)
        extra = output[1:] if isinstance(output, tuple) else ()
        io.carried_out = tuple(t for t in extra if isinstance(t, torch.Tensor))
        if isinstance(output, torch.Tensor):
            io.outputs.add(0)
        elif isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            io.outputs.add(len(output))
        else:
            io.outputs.add(-1)

    return hook
