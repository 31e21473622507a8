"""Placeholders of the layers a stage does not hold answer the model's attribute reads.

A model's forward may read its layers' attributes while iterating over them (NemotronH picks each
layer's mask by ``layer.block_type``); a placeholder must answer as the layer would, from a meta
copy, and still fail loudly for what the layer does not have.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automodel.pipeline.hf_placeholders import RunState, SkippedLayer, StageExit, Unreached
from automodel.pipeline.hf_structure import meta_copy


class _Block(nn.Module):
    def __init__(self, block_type: str) -> None:
        super().__init__()
        self.block_type = block_type
        self.mixer = nn.Linear(4, 4)


@pytest.mark.parametrize("kind", ["skipped", "exit", "unreached"])
def test_placeholder_reads_the_layer_it_stands_for(kind: str) -> None:
    layer = meta_copy(_Block("mamba"))
    placeholder = {
        "skipped": lambda: SkippedLayer(
            state=RunState(), output_len=0, hidden_kwarg=None, hand_over=False, stands_for=layer
        ),
        "exit": lambda: StageExit(None, stands_for=layer),
        "unreached": lambda: Unreached(layer),
    }[kind]()
    assert placeholder.block_type == "mamba"
    assert placeholder.mixer.weight.is_meta
    assert not list(placeholder.parameters())  # the stage holds none of the layer's parameters
    with pytest.raises(AttributeError):
        _ = placeholder.not_an_attribute


def test_skipped_layer_passes_hidden_states_on() -> None:
    skipped = SkippedLayer(state=RunState(), output_len=2, hidden_kwarg=None, hand_over=False)
    hidden = torch.ones(1, 2, 4)
    out = skipped(hidden)
    assert out[0] is hidden and out[1] is None
    with pytest.raises(AttributeError):
        _ = skipped.block_type  # nothing to stand for


class _StateLayer(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.proj, self.first = mode, nn.Linear(8, 8), False

    def forward(self, hidden_states, input_ids=None, prev=None):  # noqa: ANN001, ANN201
        out = self.proj(hidden_states)
        if self.mode == "carry":
            return out, out.sum(-1) if self.first else prev.clone()  # later layers need `prev`
        return out + input_ids.unsqueeze(-1)  # the layer reads the token ids


class _StateModel(nn.Module):
    """A toy causal LM whose layers exchange more than hidden states (as DeepSeek-V4 and HY-V4 do)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(model_type=f"toy_{mode}")  # pyright: ignore[reportCallIssue]  # configs take extra keys at run time
        self.mode = mode
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(_StateLayer(mode) for _ in range(2))
        self.layers[0].first = True
        self.lm_head = nn.Linear(8, 16)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, input_ids, position_ids=None, use_cache=None):  # noqa: ANN001, ANN201
        hidden, prev = self.embed_tokens(input_ids), None
        for layer in self.layers:
            if self.mode == "carry":
                hidden, prev = layer(hidden, prev=prev)
            else:
                hidden = layer(hidden, input_ids=input_ids)
        return self.lm_head(hidden)


@pytest.mark.parametrize(
    ("mode", "match"),
    [
        ("carry", r"toy_carry.*cannot run without the \['prev'\] the previous layer returns"),
        ("ids", r"toy_ids.*read the token ids \(\['input_ids'\]\)"),
    ],
)
def test_layers_exchanging_more_than_hidden_states_are_refused(mode: str, match: str) -> None:
    from automodel.pipeline import PipelineSplitError, validate_hf_model_for_pipeline_support

    with pytest.raises(PipelineSplitError, match=match):
        validate_hf_model_for_pipeline_support(_StateModel(mode))
