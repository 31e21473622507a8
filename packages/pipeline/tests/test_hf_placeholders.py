"""Placeholders of the layers a stage does not hold answer the model's attribute reads.

A model's forward may read its layers' attributes while iterating over them (NemotronH picks each
layer's mask by ``layer.block_type``); a placeholder must answer as the layer would, from a meta
copy, and still fail loudly for what the layer does not have.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automodel.pipeline.hf_stage import _RunState, _SkippedLayer, _StageExit, _Unreached
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
        "skipped": lambda: _SkippedLayer(
            state=_RunState(), output_len=0, hidden_kwarg=None, hand_over=False, stands_for=layer
        ),
        "exit": lambda: _StageExit(None, stands_for=layer),
        "unreached": lambda: _Unreached(layer),
    }[kind]()
    assert placeholder.block_type == "mamba"
    assert placeholder.mixer.weight.is_meta
    assert not list(placeholder.parameters())  # the stage holds none of the layer's parameters
    with pytest.raises(AttributeError):
        _ = placeholder.not_an_attribute


def test_skipped_layer_passes_hidden_states_on() -> None:
    skipped = _SkippedLayer(state=_RunState(), output_len=2, hidden_kwarg=None, hand_over=False)
    hidden = torch.ones(1, 2, 4)
    out = skipped(hidden)
    assert out[0] is hidden and out[1] is None
    with pytest.raises(AttributeError):
        _ = skipped.block_type  # nothing to stand for
