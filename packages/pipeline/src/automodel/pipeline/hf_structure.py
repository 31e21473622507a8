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

from dataclasses import dataclass

from torch import nn

from automodel.mesh.model_parts import find_layer_list, model_text_config
from automodel.pipeline.hf_boundary import BoundaryError, EntrySpec, carried_entries, check_cross_layer_reads
from automodel.pipeline.hf_classify import (
    check_layer_io,
    input_embedding_size,
    order_outside_modules,
    outside_modules,
    pre_modules_read_by_layers,
)
from automodel.pipeline.hf_tied import tied_modules_between
from automodel.pipeline.hf_trace import meta_copy, trace_layer_io
from automodel.pipeline.split import PipelineSplitError, is_within


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
    num_layers = len(layers)
    with_params, stateless, own_params = outside_modules(model, layers_fqn)
    if own_params:
        raise PipelineSplitError(
            f"model_type {model_type!r}: {own_params} hold parameters of their own outside any submodule; "
            "a stage cannot tell when the model uses them"
        )
    try:
        events, io = trace_layer_io(model, layers_fqn=layers_fqn, with_params=with_params)
    except Exception as err:  # any failure means: cannot be split generically
        raise PipelineSplitError(
            f"model_type {model_type!r}: its forward could not be traced on meta tensors to find what runs "
            f"before and after the decoder layers ({type(err).__name__}: {str(err)[:300]})"
        ) from err
    pre, post, unused, calls = order_outside_modules(
        events, with_params=with_params, num_layers=num_layers, model_type=model_type
    )
    check_layer_io(io, model_type=model_type)
    assert io.hidden_size is not None  # check_layer_io refuses a trace without one
    try:
        shared, carried = pre_modules_read_by_layers(
            model, pre, post, io, num_layers=num_layers, calls=calls, model_type=model_type
        )
        read_entries = check_cross_layer_reads(io, num_layers=num_layers, post=post, model_type=model_type)
        entries = carried_entries(io, num_layers=num_layers, read_entries=read_entries, model_type=model_type)
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
        tied_fqns=tuple(tied_modules_between(model, pre, post, model_type=model_type)),
        layer_output_len=next(iter(io.outputs)),
        hidden_kwarg=io.hidden_kwarg,
        hidden_size=io.hidden_size,
        embed_size=int(input_embedding_size(model) or io.hidden_size),
        carried_pre_fqns=tuple(carried),
        carried_pre_tensors=tuple(io.module_tensors[f] for f in carried),
        carried_entries=entries,
    )


__all__ = ["HFStructure", "PipelineSplitError", "is_within", "meta_copy", "trace_hf_structure"]
