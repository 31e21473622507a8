"""What the structure trace learns from where values flow, and the layer list of hybrid models.

A module run before the layers whose output the layers read besides the hidden states (RoFormer's
sinusoidal positions) must run on every stage; one whose output the layers read but which later
stages never compute (the input embeddings) makes the model unsplittable; a value a layer is
handed but does not use changes nothing. A list of decoder layers of two classes (OLMo-Hybrid's
attention and linear-attention layers) is still the layer list.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from automodel.pipeline.hf_dataflow import SourceTracker
from automodel.pipeline.hf_structure import PipelineSplitError, find_layer_list, trace_hf_structure

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


def test_layers_reading_the_input_embeddings_are_refused() -> None:
    with pytest.raises(PipelineSplitError, match=r"read the input embeddings \(\['embed'\]\)"):
        trace_hf_structure(_meta(extra="embeds"))


def test_a_layer_list_of_two_classes_is_the_layer_list() -> None:
    model = _meta(mixed=True)
    found = find_layer_list(model)
    assert found is not None and found[0] == "layers"
    assert trace_hf_structure(model).num_layers == LAYERS


def test_tracker_labels_follow_values_not_shapes() -> None:
    tracker = SourceTracker()
    a, b = torch.ones(3, device="meta"), torch.ones(3, device="meta")
    tracker.add([a], ["a"])
    with tracker:
        derived = (a * 2)[None]
        shaped = torch.zeros_like(a) + a.new_ones(3)
        b.add_(a)  # in place: b now derives from a
    assert tracker.sources([derived]) == {"a"}
    assert tracker.sources([shaped]) == set()
    assert tracker.sources([b]) == {"a"}
