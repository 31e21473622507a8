"""Position ids reach a learned position table at the rows the model itself would use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, RobertaConfig

from automodel.recipes.model_inputs import position_id_offset


def test_roberta_positions_start_after_the_padding_row() -> None:
    config = RobertaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=40, pad_token_id=1, is_decoder=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    offset = position_id_offset(model)
    assert offset == 2
    ids = torch.randint(3, 64, (1, 12))
    with torch.no_grad():
        own = model(input_ids=ids).logits  # the model derives its positions itself
        shifted = model(input_ids=ids, position_ids=torch.arange(12)[None] + offset).logits
        zero_based = model(input_ids=ids, position_ids=torch.arange(12)[None]).logits
    assert torch.equal(own, shifted)
    assert F.mse_loss(own, zero_based) > 1e-6  # what the recipes passed before: other rows


def test_rotary_models_take_zero_based_positions() -> None:
    config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)  # fmt: skip
    assert position_id_offset(AutoModelForCausalLM.from_config(config)) == 0
