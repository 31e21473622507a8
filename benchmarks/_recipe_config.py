"""The recipes config the CPU benchmarks train: a Llama shape from config, embedded data, FSDP2, no
checkpoints, no progress bar. One builder so every benchmark measures the same recipe path."""

from __future__ import annotations

from typing import Any

#: FSDP2 in plain fp32 (the default policy would compute in bf16 where the device supports it).
FP32_MIXED_PRECISION = {
    "_target_": "torch.distributed.fsdp.MixedPrecisionPolicy",
    "param_dtype": "float32",
    "reduce_dtype": "float32",
}


def llama(
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_positions: int,
    vocab: int = 256,
) -> dict[str, Any]:
    """A Hugging Face Llama config (as the YAML's ``model.config``) with untied embeddings."""
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": False,
    }


def recipe_config(
    *,
    model: dict[str, Any],
    seq_length: int,
    max_bytes: int,
    local_batch: int,
    global_batch: int,
    output_dir: str | None = None,
    steps: int | None = None,
    fp32: bool = False,
    **sections: dict[str, Any],
) -> dict[str, Any]:
    """The raw recipes config; `sections` are merged into the section of the same name."""
    cfg: dict[str, Any] = {"seed": 0}
    if output_dir is not None:
        cfg["output_dir"] = output_dir
    cfg["model"] = {"config": dict(model), **({"dtype": "float32"} if fp32 else {})}
    cfg["dataset"] = {"source": "embedded", "seq_length": seq_length, "max_bytes": max_bytes}
    cfg["step_scheduler"] = {"global_batch_size": global_batch, "local_batch_size": local_batch}
    if steps is not None:
        cfg["step_scheduler"]["max_steps"] = steps
    cfg["optimizer"] = {"_target_": "torch.optim.AdamW", "lr": 1e-3}
    cfg["distributed"] = {"strategy": "fsdp2", **({"mp_policy": dict(FP32_MIXED_PRECISION)} if fp32 else {})}
    cfg["checkpoint"] = {"enabled": False}
    cfg["logging"] = {"progress_bar": False}
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg
