"""What the structure trace learns from where values flow, and the layer list of hybrid models.

A module run before the layers whose output the layers read besides the hidden states (RoFormer's
sinusoidal positions) must run on every stage; one whose output the layers read but which later
stages cannot compute (the input embeddings) is handed over by the first stage; entries one layer
writes into a mapping every layer gets and a later one reads (a shared key/value cache) are handed
over too; anything else a layer reads from an earlier one is refused; a value a layer is handed
but does not use changes nothing. A list of decoder layers of two classes (OLMo-Hybrid's
attention and linear-attention layers) is still the layer list.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from automodel.mesh.model_parts import find_layer_list
from automodel.pipeline.hf_dataflow import SourceTracker
from automodel.pipeline.hf_structure import PipelineSplitError, trace_hf_structure

WIDTH, VOCAB, LAYERS = 8, 16, 4


class _Layer(nn.Module):
    def __init__(self, *, reads: bool) -> None:
        super().__init__()
        self.proj, self.reads = nn.Linear(WIDTH, WIDTH), reads

    def forward(self, hidden_states: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        out = self.proj(hidden_states)
        return out + extra if self.reads else out


class _OtherLayer(_Layer):
    pass


class _Toy(nn.Module):
    """A causal LM whose layers get `extra` besides the hidden states: a frozen table's output
    (``extra="table"``) or the input embeddings (``extra="embeds"``); `reads` says whether they use it."""

    def __init__(self, *, extra: str = "table", reads: bool = True, mixed: bool = False) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=LAYERS, model_type=f"toy_{extra}")
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.table = nn.Embedding(64, WIDTH)
        self.table.weight.requires_grad_(False)
        kinds = [_OtherLayer if mixed and i % 2 else _Layer for i in range(LAYERS)]
        self.layers = nn.ModuleList(kind(reads=reads) for kind in kinds)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.extra = extra

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None, **_):  # noqa: ANN001, ANN201
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        seq = hidden.shape[1]
        extra = self.table(torch.arange(seq, device=hidden.device))[None] if self.extra == "table" else hidden
        for layer in self.layers:
            hidden = layer(hidden, extra)
        return SimpleNamespace(logits=self.head(hidden))


def _meta(**kwargs: object) -> nn.Module:
    with torch.device("meta"):
        return _Toy(**kwargs)


def test_a_table_every_layer_reads_runs_on_every_stage() -> None:
    structure = trace_hf_structure(_meta(extra="table"))
    assert structure.pre_fqns == ("embed", "table")
    assert structure.shared_pre_fqns == ("table",)


def test_a_value_handed_to_the_layers_but_unused_changes_nothing() -> None:
    assert trace_hf_structure(_meta(extra="table", reads=False)).shared_pre_fqns == ()
    assert trace_hf_structure(_meta(extra="embeds", reads=False)).shared_pre_fqns == ()


def test_the_input_embeddings_the_layers_read_are_handed_over() -> None:
    structure = trace_hf_structure(_meta(extra="embeds"))
    assert structure.shared_pre_fqns == ()
    assert (structure.carried_pre_fqns, structure.carried_pre_tensors) == (("embed",), (1,))
    assert structure.carried_tensors_at(2) == 1 and structure.carried_tensors_at(0) == 0


class _CacheLayer(nn.Module):
    """Writes its keys into the mapping every layer gets (``store``) or reads the first layer's."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.proj, self.index = nn.Linear(WIDTH, WIDTH), index

    def forward(self, hidden_states: torch.Tensor, shared: dict, kept: list) -> torch.Tensor:
        out = self.proj(hidden_states)
        if self.index == 0:
            shared["keys"] = (out * 2, out * 3)
            kept.append(out * 4)
        elif self.index == LAYERS - 1:
            out = out + shared["keys"][1] + (kept[-1] if len(kept) > 1 else 0)
        return out


class _CacheToy(_Toy):
    """The last layer reads keys the first layer stored in a mapping handed to every layer
    (``reads="entry"``), or a tensor the first layer left in a list the model keeps (``"kept"``)."""

    def __init__(self, reads: str) -> None:
        super().__init__(extra="table", reads=False)
        self.config.model_type = f"toy_{reads}"
        self.layers = nn.ModuleList(_CacheLayer(i) for i in range(LAYERS))
        self.reads = reads

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None, **_):  # noqa: ANN001, ANN201
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        shared: dict = {}
        kept: list = [] if self.reads == "entry" else [None]
        for layer in self.layers:
            hidden = layer(hidden, shared, kept)
        return SimpleNamespace(logits=self.head(hidden))


def test_entries_a_later_layer_reads_from_a_shared_mapping_are_handed_over() -> None:
    with torch.device("meta"):
        structure = trace_hf_structure(_CacheToy("entry"))
    assert structure.carried_pre_fqns == ()
    assert [[(e.loc, e.key, e.leaves) for e in structure.entries_at(b)] for b in range(LAYERS)] == [
        [],
        *[[("argument 1", "keys", 2)]] * (LAYERS - 1),
    ]
    assert structure.carried_tensors_at(1) == 2


def test_a_value_kept_from_an_earlier_layer_elsewhere_is_refused() -> None:
    with torch.device("meta"), pytest.raises(PipelineSplitError, match=r"toy_kept.*decoder layer 3 reads"):
        trace_hf_structure(_CacheToy("kept"))


def test_a_layer_list_of_two_classes_is_the_layer_list() -> None:
    model = _meta(mixed=True)
    found = find_layer_list(model)
    assert found is not None and found[0] == "layers"
    assert trace_hf_structure(model).num_layers == LAYERS


def test_tracker_labels_follow_values_not_shapes() -> None:
    tracker = SourceTracker()
    a, b, c = torch.ones(3, device="meta"), torch.ones(3, device="meta"), torch.ones(2, 3, device="meta")
    tracker.add([a], ["a"])
    with tracker:
        derived = (a * 2)[None]
        shaped = torch.zeros_like(a) + a.new_ones(3)
        b.add_(a)  # in place: b now derives from a
        c[1:].add_(a)  # in place into a slice: c derives from a too
    assert tracker.sources([derived]) == {"a"}
    assert tracker.sources([shaped]) == set()
    assert tracker.sources([b]) == {"a"}
    assert tracker.sources([c]) == {"a"}


def test_nearest_labels_stop_at_module_outputs_and_name_the_running_layer() -> None:
    tracker = SourceTracker()
    a = torch.ones(3, device="meta")
    tracker.add([a], ["a"])
    with tracker:
        b = a * 2
        tracker.replace([b], {"a", "m"}, nearest=["m"])  # b is module m's output
        c = b + 1
        tracker.inside = "layer:0"
        d = c * 3
        tracker.inside = None
    assert (tracker.sources([c]), tracker.nearest([c])) == ({"a", "m"}, {"m"})
    assert tracker.nearest([d]) == {"m", "layer:0"}
