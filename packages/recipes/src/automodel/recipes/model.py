"""Build the Hugging Face model config and an unmaterialized (meta-device) model from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from automodel.recipes.errors import ConfigError
from automodel.recipes.instantiate import resolve_dtype
from automodel.recipes.trust import announce_remote_code


def build_hf_config(section: Any, *, announce: bool = True) -> Any:
    """A transformers config from ``model.config`` (with ``model_type``) or ``model.pretrained_path``.

    With ``model.trust_remote_code: true`` and `announce`, rank 0 prints that the directory's code
    may run (the pre-launch layout check passes ``announce=False``: the run itself says it once).
    """
    from transformers import AutoConfig

    if section.config is not None:
        kwargs = dict(section.config)
        model_type = kwargs.pop("model_type")
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if model_type not in CONFIG_MAPPING_NAMES:
            raise ConfigError("model.config.model_type", model_type, "is not a transformers model type")
        try:
            cfg = AutoConfig.for_model(model_type, **kwargs)
        except ValueError as e:
            raise ConfigError(
                "model.config.model_type", model_type, f"is not a transformers model type ({e})"
            ) from None
        except TypeError as e:
            raise ConfigError(
                "model.config", kwargs, f"is not accepted by the {model_type} config ({e})"
            ) from None
    else:
        path = Path(section.pretrained_path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                "model.pretrained_path", str(path), "is not a local HF model directory (no config.json)"
            )
        trust = section.trust_remote_code
        if trust and announce:
            announce_remote_code(key="model.trust_remote_code", path=str(path))
        try:
            cfg = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust)
        except ValueError as e:
            if not trust and "trust_remote_code" in str(e):
                raise ConfigError(
                    "model.trust_remote_code",
                    False,
                    f"{path} needs its own Python code (config.json auto_map) to load; it was not run. "
                    "Set model.trust_remote_code: true only if you trust that directory",
                ) from None
            raise
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        value = getattr(cfg, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"model.config.{key}", value, "must be an int >= 1")
    cfg._attn_implementation = section.attn_implementation
    return cfg


def build_meta_model(hf_config: Any, *, dtype: str = "float32", trust_remote_code: bool = False) -> nn.Module:
    """The causal-LM for `hf_config` with every parameter and buffer on the meta device.

    `trust_remote_code` (YAML ``model.trust_remote_code``) lets a config's ``auto_map`` import
    model code from its directory; off, only transformers' own classes are used.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
        except ValueError as e:
            if not trust_remote_code and "trust_remote_code" in str(e):
                raise ConfigError(
                    "model.trust_remote_code",
                    False,
                    "the model class is custom code (config auto_map); set it to true only if you trust it",
                ) from None
            raise ConfigError(
                "model.config.model_type", hf_config.model_type, f"has no causal-LM class ({e})"
            ) from None
    return model.to(resolve_dtype("model.dtype", dtype))


def num_experts(hf_config: Any) -> int | None:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
