"""FP8 training through torchao's float8: `nn.Linear` -> `Float8Linear` on the meta-device model.

The conversion runs before any parallelism (as torchtitan converts its meta model): FSDP2 then
shards the converted modules, and with ``enable_fsdp_float8_all_gather`` their weights are
torchao's `WeightWithDynamicFloat8CastTensor`, which FSDP2 all-gathers in float8. Tensor
parallelism would need torchao's float8 TP styles instead of the plain ones and is refused
(`check_fp8_rules`), so "after TP, before FSDP" holds trivially.

Which modules convert: every `nn.Linear` whose FQN contains none of ``fp8.filter_fqns`` (NeMo
AutoModel's substring rule) and whose two dimensions are multiples of 16 (``torch._scaled_mm``),
except the output head that the chunked loss reads (its matmul is in the loss, never in the
head's forward).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch
from torch import nn

from automodel.recipes.config.kernels import FP8Section
from automodel.recipes.errors import ConfigError
from automodel.recipes.torch_internals import emulate_precision_casts

INSTALL = "pip install 'automodel-recipes[fp8]'"
#: float8 matmuls (torch._scaled_mm) need both dimensions divisible by this
FP8_DIM_MULTIPLE = 16
#: the first NVIDIA compute capability with float8 tensor cores (Ada, Hopper)
FP8_MIN_CAPABILITY = (8, 9)


def fp8_unavailable(section: FP8Section) -> tuple[str, str] | None:
    """``(key, why)`` when float8 training cannot run on this machine (None: it can)."""
    try:
        importlib.import_module("torchao.float8")
    except ImportError as e:
        return "fp8.enabled", f"needs the torchao package, which is not importable ({e}); {INSTALL}"
    if section.emulate:
        return None
    if not torch.cuda.is_available():
        return (
            "fp8.enabled",
            "needs a CUDA GPU with float8 (compute capability >= 8.9); this machine has none",
        )
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        return (
            "fp8.enabled",
            f"needs compute capability >= 8.9 for float8 matmuls; this GPU has {capability[0]}.{capability[1]} "
            "(fp8.emulate: true runs the same maths in high precision, for tests)",
        )
    return None


def torchao_config(section: FP8Section):
    """torchao's `Float8LinearConfig` for the section: the recipe's, then the section's switches."""
    # lazy: optional dependency (torchao, the [fp8] extra)
    from torchao.float8 import Float8LinearConfig

    switches: dict[str, bool] = {
        "enable_fsdp_float8_all_gather": section.enable_fsdp_float8_all_gather,
        "emulate": section.emulate,
    }
    if (
        section.force_recompute_fp8_weight_in_bwd
    ):  # deprecated in torchao 0.18 (it warns): set only when asked
        switches["force_recompute_fp8_weight_in_bwd"] = True
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(section.recipe), **switches)


def fp8_filter(section: FP8Section, *, keep: tuple[str, ...] = ()) -> Callable[[nn.Module, str], bool]:
    """``filter(module, fqn)``: whether torchao converts that module. `keep`: exact FQNs kept in
    high precision whatever the section says (the head the chunked loss reads)."""

    def convert(module: nn.Module, fqn: str) -> bool:
        if fqn in keep or any(f in fqn for f in section.filter_fqns):
            return False
        if not isinstance(module, nn.Linear):
            return False
        return module.in_features % FP8_DIM_MULTIPLE == 0 and module.out_features % FP8_DIM_MULTIPLE == 0

    return convert


def convert_to_fp8(model: nn.Module, *, section: FP8Section, keep: tuple[str, ...] = ()) -> list[str]:
    """Swap `model`'s selected `nn.Linear` modules for torchao's `Float8Linear`; returns their FQNs.

    `ConfigError` naming ``fp8.filter_fqns`` when nothing is left to convert (an fp8 run that would
    train in high precision)."""
    # lazy: optional dependency (torchao, the [fp8] extra)
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    if section.recipe == "rowwise":  # torchao's advice for rowwise under inductor (AutoModel does the same)
        emulate_precision_casts()
    convert_to_float8_training(
        model, config=torchao_config(section), module_filter_fn=fp8_filter(section, keep=keep)
    )
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    if not converted:
        raise ConfigError(
            "fp8.filter_fqns",
            list(section.filter_fqns),
            f"leaves no linear layer to convert to float8 (kept: {', '.join(keep) or 'none'}; dimensions must "
            f"be multiples of {FP8_DIM_MULTIPLE})",
        )
    return converted


def describe_fp8(model: nn.Module, *, section: FP8Section, converted: list[str]) -> str:
    """The start-up line: what runs in float8 and what stays in high precision."""
    kept = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in set(converted)]
    options = [
        name
        for name, on in (
            ("float8 all-gather", section.enable_fsdp_float8_all_gather),
            ("precomputed scales", section.precompute_float8_dynamic_scale_for_fsdp),
            ("weight recomputed in backward", section.force_recompute_fp8_weight_in_bwd),
            ("EMULATED", section.emulate),
        )
        if on
    ]
    return (
        f"fp8: torchao float8 {section.recipe} on {len(converted)} linear layers"
        + (f" ({', '.join(options)})" if options else "")
        + (f"; high precision: {', '.join(kept)}" if kept else "")
    )


def precompute_scales(parts: list[nn.Module]) -> Callable[[], None]:
    """The after-optimizer-step hook of ``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce
    computes every float8 weight's scale for the next step's all-gathers."""
    # lazy: optional dependency (torchao, the [fp8] extra)
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook() -> None:
        for part in parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    return hook
