"""Build the Hugging Face model config and an unmaterialized (meta-device) model from it."""

from __future__ import annotations

import copy
import difflib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import is_flash_attn_2_available

from automodel.data.hub_cache import resolve_local_or_cached
from automodel.data.trust import announce_remote_code

# The config facts live in model_parts (one home); num_experts / experts_per_token are re-exported
# for the rules and the planner, which import them from here.
from automodel.mesh.model_parts import experts_per_token as experts_per_token
from automodel.mesh.model_parts import layer_values
from automodel.mesh.model_parts import num_experts as num_experts
from automodel.recipes.config.build import resolve_dtype
from automodel.recipes.config.sections import ModelSection
from automodel.recipes.errors import ConfigError
from automodel.recipes.file_kind import read_json_object
from automodel.recipes.model_inputs import check_defaulted_inputs


def build_hf_config(section: ModelSection, *, announce: bool = True) -> Any:
    """A transformers config from ``model.config`` (with ``model_type``) or a pretrained directory
    (``model.pretrained_model_name_or_path``, alias ``model.pretrained_path``).

    With ``model.trust_remote_code: true`` and `announce`, rank 0 prints that the directory's code
    may run (the pre-launch layout check passes ``announce=False``: the run itself says it once).
    """
    if section.config is not None:
        kwargs = dict(section.config)
        model_type = kwargs.pop("model_type")

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
        check_config_keys(cfg, kwargs)
    else:
        path = pretrained_dir(section)
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
        _refuse_quantized(cfg, section)
        overrides = section.config_overrides or {}
        check_config_keys(cfg, overrides, prefix="model.config_overrides")
        for key, value in overrides.items():
            setattr(cfg, key, value)
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        for value in layer_values(cfg, key):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"model.config.{key}", value, "must be an int >= 1")
    cfg._attn_implementation = resolve_attn_implementation(cfg, section.attn_implementation)
    cls = causal_lm_class(cfg)
    if cls is not object:  # remote code: its class is known only once loaded
        check_defaulted_inputs(cfg, model_cls=cls, section=section)
    return cfg


def check_config_keys(cfg: PretrainedConfig, given: dict[str, Any], *, prefix: str = "model.config") -> None:
    """Refuse a ``model.config`` key that the config class neither declares nor converts.

    transformers keeps any unknown keyword as a plain attribute, so a typo (``num_hidden_layer``)
    leaves the real field at its default and trains another model. A key is known when the default
    config has it, or when passing it alone changes some other field (a legacy name the class
    converts: ``rope_theta``, ``rope_scaling``, ``torch_dtype``); otherwise it is refused, with the
    closest declared key.
    """
    default = type(cfg)()
    declared = set(vars(default)) | set(getattr(cfg, "attribute_map", {}) or {})
    base = default.to_dict()
    for key, value in given.items():
        if key in declared:
            continue
        try:
            alone = type(cfg)(**{key: value}).to_dict()
        except Exception:  # noqa: BLE001 - the full config was accepted; judge the key by name only
            alone = {**base, key: value}
        if any(alone.get(k) != base.get(k) for k in set(alone) | set(base) if k != key):
            continue  # a legacy name the class converts into its own fields
        if _read_by_model_code(cfg, key):
            continue  # getattr(config, "head_dim", ...) in the modeling code: optional, not declared
        public = sorted(k for k in declared if not k.startswith("_"))
        close = difflib.get_close_matches(key, public, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"{prefix}.{key}",
            value,
            f"is not a key of {type(cfg).__name__} (model_type {cfg.model_type!r}); {hint}"
            "transformers would keep it as an unused attribute and train with the default instead",
        )


def _read_by_model_code(cfg: PretrainedConfig, key: str) -> bool:
    """Whether `key` appears as a name in the source of the model's config or modeling module."""
    modules = [sys.modules.get(type(cfg).__module__)]
    try:
        modules.append(sys.modules.get(causal_lm_class(cfg).__module__))
    except ConfigError:
        pass
    pattern = re.compile(rf"\b{re.escape(key)}\b")
    for module in modules:
        try:
            if module is not None and pattern.search(inspect.getsource(module)):
                return True
        except (OSError, TypeError):
            continue
    return False


def _refuse_quantized(cfg: PretrainedConfig, section: ModelSection) -> None:
    """A quantized checkpoint (fp8 blocks with scales, GPTQ, AWQ, bitsandbytes, ...) holds integers or
    fp8 codes plus scales; read as plain weights it would train on garbage, so it is refused."""
    quantization = getattr(cfg, "quantization_config", None)
    if not quantization:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    method = method or getattr(quantization, "quant_method", None) or "unknown"
    raise ConfigError(
        section.pretrained_key,
        section.pretrained_source or section.pretrained_path,
        f"holds a quantized checkpoint (config.json quantization_config, quant_method {str(method)!r}); "
        "training reads full-precision weights: dequantize it to bf16/fp32 safetensors first",
    )


def pretrained_dir(section: ModelSection) -> Path:
    """The local directory of ``model.pretrained_model_name_or_path`` (alias ``model.pretrained_path``):
    the directory itself, or the cached snapshot of a Hub id (never downloaded; `ConfigError` naming
    the key when it is not cached or its config.json is missing, unreadable or not a JSON object)."""
    source = section.pretrained_path or section.pretrained_source
    directory = resolve_local_or_cached(source, key=section.pretrained_key, required_file="config.json")
    read_json_object(directory / "config.json", key=section.pretrained_key, value=source)
    return directory


#: Attention implementations a model class declares support for, by its class flag (eager: all).
_ATTN_SUPPORT_FLAGS = {
    "sdpa": "_supports_sdpa",
    "flex_attention": "_supports_flex_attn",
    "flash_attention_2": "_supports_flash_attn",
}


def causal_lm_class(hf_config: PretrainedConfig) -> type:
    """transformers' causal-LM class for `hf_config` (ConfigError when the model_type has none)."""
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]  # pyright: ignore[reportReturnType]  # a class; transformers types it _LazyAutoMappingValue
    except KeyError:
        pass
    if getattr(hf_config, "auto_map", None) and "AutoModelForCausalLM" in hf_config.auto_map:
        return object  # the directory's own class (trust_remote_code); its flags are read after loading
    raise ConfigError(
        "model.config.model_type",
        hf_config.model_type,
        "has no causal-LM class in transformers (AutoModelForCausalLM does not map it)",
    )


def resolve_attn_implementation(hf_config: PretrainedConfig, requested: str) -> str:
    """``auto``: sdpa where the model supports it, else eager. A named implementation the model
    does not support is a ConfigError naming the model_type and what it supports."""
    cls = causal_lm_class(hf_config)
    if cls is object:
        return "eager" if requested == "auto" else requested
    supported = ["eager"] + [impl for impl, flag in _ATTN_SUPPORT_FLAGS.items() if getattr(cls, flag, False)]
    if requested == "auto":
        return "sdpa" if "sdpa" in supported else "eager"
    if requested not in supported:
        raise ConfigError(
            "model.attn_implementation",
            requested,
            f"is not supported by model_type {hf_config.model_type!r} ({cls.__name__}); it supports "
            f"{', '.join(supported)} (or auto)",
        )
    return requested


def _without_unimportable_kernels(hf_config: PretrainedConfig) -> Any:
    """`hf_config`, or a copy asking for sdpa where it asks for flash_attention_2 and flash-attn is
    not importable here: transformers refuses to build such a model at all, but `recipes validate`
    plans GPU clusters from any machine and the model's structure does not depend on the kernel
    (`recipes train` refuses flash_attention_2 where it is missing, see environment.py)."""
    if getattr(hf_config, "_attn_implementation", None) != "flash_attention_2":
        return hf_config

    if is_flash_attn_2_available():
        return hf_config
    planned = copy.deepcopy(hf_config)  # composite configs pass the setting on to their parts
    planned._attn_implementation = "sdpa"
    return planned


def build_meta_model(
    hf_config: PretrainedConfig, *, dtype: str = "float32", trust_remote_code: bool = False
) -> nn.Module:
    """The causal-LM for `hf_config` with every parameter and buffer on the meta device.

    `trust_remote_code` (YAML ``model.trust_remote_code``) lets a config's ``auto_map`` import
    model code from its directory; off, only transformers' own classes are used.
    """
    hf_config = _without_unimportable_kernels(hf_config)
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
            causal_lm_class(hf_config)  # a model_type without a causal-LM class says so
            raise ConfigError(
                "model.config", hf_config.model_type, f"cannot be built by transformers: {e}"
            ) from None
        except RuntimeError as e:
            if type(e).__name__ != "AmbiguousGlobalPerLayerAttributeError":
                raise
            # per_layer_config on a model whose code reads the attribute once for every layer
            raise ConfigError(
                "model.config.per_layer_config",
                sorted(getattr(hf_config, "per_layer_attributes", ())),
                f"model_type {hf_config.model_type!r} reads these once for all its layers (its code does "
                "not support per-layer values of them)",
            ) from None
    return model.to(resolve_dtype("model.dtype", dtype))
