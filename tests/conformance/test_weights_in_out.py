"""HF weights in and out per architecture: a model saved by transformers, loaded by the recipes into
a layout, gives transformers' own loss; the consolidated checkpoint written after training loads
back with ``from_pretrained`` (no missing or unexpected keys) to the same logits as the one-process
run's checkpoint. The check lives in `weights_check.py`; `weights_sweep.py` runs it over the
registry and writes docs/weights.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from weights_check import WeightsCase, WeightsMismatch, reload_logits, save_tiny_pretrained  # noqa: E402

CASES = [
    ("gemma3_text", "pp2"),  # tied, scaled embedding, sliding layers
    ("gpt2", "pp2"),  # Conv1D projections, learned positions, tied
    ("qwen3_moe", "ep2"),  # stacked experts
    ("mixtral", "ep2"),  # checkpoint keeps per-expert w1/w3/w2: transformers' conversion mapping both ways
    ("minimax_m3_vl_text", "tp2"),  # gathered colwise q/k: its q/k norms' gradients were summed twice
    ("gemma4_text", "tp2"),  # per-layer head widths (heterogeneous config)
    ("gemma3", "tp2"),  # multimodal checkpoint: text decoder laid out, vision tower kept whole
]


@pytest.mark.parametrize(("model_type", "layout"), CASES)
def test_hf_weights_in_and_out(model_type: str, layout: str, tmp_path: Path) -> None:
    WeightsCase(model_type, tmp_path).check(layout)


def test_reload_check_catches_a_dropped_weight(tmp_path: Path) -> None:
    """A checkpoint missing a tensor fails even when transformers' fresh init could hide it."""
    from safetensors.torch import load_file, save_file

    save_tiny_pretrained("llama", tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    norm = next(k for k in tensors if k.endswith("input_layernorm.weight"))  # ones when fresh
    del tensors[norm]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(WeightsMismatch, match="missing_keys"):
        reload_logits(tmp_path, vocab_size=256)
