"""Shared tiny configs and rank functions for the recipes tests."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from automodel.recipes.config.kernels import AUTOMODEL_EXAMPLE_FP8
from automodel.testing.tiny_model import TINY_MOE_SIZES, TINY_SIZES

TINY: dict[str, Any] = {
    "seed": 7,
    "model": {"config": {"model_type": "llama", **TINY_SIZES}},
    "dataset": {"source": "embedded", "seq_length": 32, "max_bytes": 40000},
    "validation_dataset": {"source": "embedded", "seq_length": 32, "max_bytes": 8000},
    "step_scheduler": {"global_batch_size": 8, "local_batch_size": 2, "max_steps": 3, "val_every_steps": 3},
    "optimizer": {"_target_": "torch.optim.AdamW", "lr": 0.003, "foreach": False},
    "lr_scheduler": {"warmup_steps": 1, "decay_style": "cosine", "min_lr": 0.0003},
    "distributed": {"strategy": "fsdp2"},
    "checkpoint": {"enabled": False},
    "logging": {"progress_bar": False},
}


#: The tiny MoE model of the recipes tests (Qwen3-MoE, 4 experts, top-2).
MOE_MODEL = {"config": {"model_type": "qwen3_moe", **TINY_SIZES, "head_dim": 16, **TINY_MOE_SIZES}}

RTOL = 1e-5

AUTOMODEL_FP8 = AUTOMODEL_EXAMPLE_FP8


def assert_losses_close(got: list[float], ref: list[float]) -> None:
    """Per-step losses equal the reference to RTOL (fp32 parity with one process)."""
    assert len(got) == len(ref)
    for step, (g, r) in enumerate(zip(got, ref), start=1):
        assert abs(g - r) <= RTOL * abs(r), f"step {step}: {g} vs reference {r}"


def tiny_config(output_dir: str, **sections: Any) -> dict[str, Any]:
    """TINY with `output_dir` and sections merged in (a None value deletes the section)."""
    cfg = copy.deepcopy(TINY)
    cfg["output_dir"] = output_dir
    for key, value in sections.items():
        if value is None:
            cfg.pop(key, None)
        elif isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def train_on_rank(raw: dict[str, Any]) -> list[float]:
    """Rank function: parse and train `raw`; every rank returns the per-step losses, then the
    validation losses (so parity covers the evaluation path too)."""
    from automodel.recipes import load_config
    from automodel.recipes.trainer import run_training

    result = run_training(load_config(raw))
    return result.losses + [result.val_losses[k] for k in sorted(result.val_losses)]


def preload() -> None:
    """Import the heavy modules once in the test process so forked ranks start warm."""
    import transformers.models.llama.modeling_llama  # noqa: F401

    import automodel.fsdp2  # noqa: F401
    import automodel.recipes.trainer  # noqa: F401


#: The id the sparse tokenizer gives "z": far beyond any tiny model's vocab_size, while its
#: ``len()``/``vocab_size`` stay under 256.
SPARSE_TOKENIZER_BIG_ID = 2_000_000_000


def write_sparse_tokenizer(directory: Path) -> Path:
    """A character-level tokenizer whose "z" is id 2e9, written as files into `directory`.

    Saved by the ``tokenizers`` library with "z" at a small id, then given its large id in the
    JSON: saving the large id directly walks every id up to it (~18 s with ``tokenizers``, ~90 s
    with transformers' ``save_pretrained``); loading it does not.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    placeholder = 200
    vocab = {chr(c): c for c in range(32, 122)} | {"<eos>": 0, "<unk>": 1, "z": placeholder}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    directory.mkdir(parents=True)
    spec = json.loads(tok.to_str())
    assert spec["model"]["vocab"]["z"] == placeholder
    spec["model"]["vocab"]["z"] = SPARSE_TOKENIZER_BIG_ID
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "unk_token": "<unk>"})
    )
    return directory
