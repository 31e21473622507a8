"""``model.backend``: AutoModel's kernel choices for its own model implementations.

This project trains the transformers model's own modules, so these choices select no kernel
here. Kernels of other libraries that compute the same math (grouped GEMM, DeepEP, TileLang,
transformer-engine's attention, linear, RMSNorm and grouped experts, ...) are accepted and listed
in one start-up line; for transformer-engine (``te``) the line says its kernels are not used (no
module of this project's training path calls one, whether or not transformer-engine is installed).
Values that change the math (``fake_balanced_gate: true``, a TE FP8 recipe ``te_fp8``) are refused
by `recipes train` and `recipes validate` before launch, naming the key.
"""

from __future__ import annotations

from typing import Any

from automodel.recipes.compat.aliases import match
from automodel.recipes.config.build import resolve_dtype
from automodel.recipes.errors import ConfigError

#: key -> the values AutoModel accepts (None: any value of the listed Python type)
CHOICES: dict[str, tuple[Any, ...]] = {
    "attn": ("te", "sdpa", "flex", "eager", "tilelang", "cudnn", "magi", "torch"),
    "linear": ("torch", "te", "quack"),
    "rms_norm": ("torch", "torch_fp32", "te", "quack"),
    "rope": ("torch", "quack"),
    "experts": ("torch", "te", "gmm", "torch_mm", "torch_mm_mxfp8"),
    "dispatcher": ("torch", "deepep", "hybridep", "uccl_ep", "mok"),
}
FLAGS = (
    "rope_fusion",
    "enable_hf_state_dict_adapter",
    "enable_fsdp_optimizations",
    "compile_attn",
    "dispatcher_share_token_dispatcher",
    "dispatcher_async_dispatch",
)
#: per key, the value that names what runs here instead of ``te`` (said in the start-up line)
INSTEAD_OF_TE = {"attn": "sdpa", "linear": "torch", "rms_norm": "torch_fp32", "experts": "torch"}
#: what the transformers modules compute, per key (a choice equal to it needs no note)
HERE = {
    "attn": "sdpa",
    "linear": "torch",
    "rms_norm": "torch",
    "rope": "torch",
    "experts": "torch",
    "dispatcher": "torch",
}


def read_backend(data: Any, *, refusals: list[ConfigError]) -> str | None:
    """Check ``model.backend``; the start-up line for the kernels not used here (None: nothing to
    say). Valid settings that change the math and are not implemented go to `refusals` (refused by
    `recipes train` before launch)."""
    noted, te = _read(data, refusals=refusals)
    lines = []
    if noted:
        lines.append(
            f"model.backend: {', '.join(noted)} are kernels of AutoModel's own model implementations; "
            "here the transformers model's modules run (same math)"
        )
    if te:
        lines.append(
            f"model.backend: {', '.join(f'{k}=te' for k in te)}: transformer-engine's kernels are not used; "
            "the transformers model's own modules run as "
            f"{', '.join(f'{k}={INSTEAD_OF_TE[k]}' for k in te)} (same math)"
        )
    return "; ".join(lines) or None


def _read(data: Any, *, refusals: list[ConfigError]) -> tuple[list[str], list[str]]:
    """``(the choices of other kernels, the keys set to te)``; refusals appended to `refusals`."""
    if not isinstance(data, dict):
        raise ConfigError("model.backend", data, "must be a mapping (AutoModel's BackendConfig)")
    data = dict(data)
    if "_target_" in data:
        target = data.pop("_target_")
        if not (isinstance(target, str) and target.endswith("BackendConfig")):
            match("model", target, key="model.backend._target_")  # raises with the known names
    noted: list[str] = []
    te: list[str] = []
    for key, value in data.items():
        k = f"model.backend.{key}"
        if key in CHOICES:
            if value not in CHOICES[key]:
                raise ConfigError(k, value, f"must be one of {', '.join(CHOICES[key])}")
            if value == "te":
                te.append(key)
            elif value not in (HERE[key], "torch", "sdpa", "eager", "torch_fp32"):
                noted.append(f"{key}={value}")
        elif key in FLAGS:
            if not isinstance(value, bool):
                raise ConfigError(k, value, "must be true or false")
        elif key == "fake_balanced_gate":
            if value is not False:
                refusals.append(
                    ConfigError(k, value, "AutoModel's benchmark gate (fake routing) is not implemented here")
                )
        elif key == "gate_precision":
            if value is not None:
                resolve_dtype(k, value)
                noted.append(f"gate_precision={value}")
        elif key == "dispatcher_num_sms":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(k, value, "must be an int")
        elif key == "fake_gate_noise":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(k, value, "must be a number")
        elif key == "te_fp8":
            refusals.append(ConfigError(k, value, "FP8 training is not implemented in this project"))
        else:
            raise ConfigError(k, value, f"unknown key; known keys: {', '.join(sorted([*CHOICES, *FLAGS]))}")
    return noted, te
