"""`recipes plan`: rank the layouts of a model on a number of GPUs, checked as `recipes train`
would check them before launch, and print them."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from automodel.recipes.config.peft import PeftSection
from automodel.recipes.config.sections import build_section
from automodel.recipes.errors import ConfigError
from automodel.recipes.model import build_meta_model
from automodel.recipes.peft import apply_lora
from automodel.recipes.planning.admit import admit_layouts, global_batch_of
from automodel.recipes.planning.models import resolve_model_config
from automodel.recipes.planning.roofline import Hardware
from automodel.recipes.planning.search import enumerate_layouts
from automodel.recipes.planning.shape import model_shape
from automodel.recipes.planning.table import format_memory, format_table, yaml_block

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def parse_bytes(key: str, value: str) -> float:
    """``80GiB``, ``80GB``, ``81920MiB`` or a number of bytes (`ConfigError` naming `key`)."""
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "tb": 1e12, "gb": 1e9, "mb": 1e6, "b": 1}
    text = str(value).strip().lower().replace(" ", "")
    for unit, factor in units.items():
        if text.endswith(unit):
            text, scale = text[: -len(unit)], factor
            break
    else:
        scale = 1
    try:
        number = float(text) * scale
    except ValueError:
        raise ConfigError(key, value, "must be a size such as 80GiB, 141GB or 81920MiB") from None
    if number <= 0:
        raise ConfigError(key, value, "must be > 0")
    return number


def plan(
    *,
    model: str,
    gpus: int,
    seq_len: int,
    gpus_per_node: int = 8,
    gpu_memory: float = 80 * 2**30,
    global_batch: int | None = None,
    peft: str | None = None,
    top: int = 10,
    hardware: Hardware | None = None,
    expert_load_factor: float = 1.0,
) -> tuple[list[Any], list[str]]:
    """Rank the layouts of `model` on `gpus` GPUs; returns the candidates and the printed lines."""
    if gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", gpus_per_node, "must be >= 1")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ConfigError("--gpus", gpus, f"must be a multiple of --gpus-per-node={gpus_per_node}")
    if peft not in (None, "lora"):
        raise ConfigError("--peft", peft, "must be lora (or left out for full fine-tuning)")
    hw = replace(hardware or Hardware(), memory_bytes=gpu_memory, gpus_per_node=min(gpus_per_node, gpus))
    hf_config = resolve_model_config(model)
    shape = model_shape(hf_config)
    trainable = _lora_params(hf_config) if peft == "lora" else None
    cands = enumerate_layouts(
        shape,
        gpus=gpus,
        seq_len=seq_len,
        hardware=hw,
        global_batch=global_batch,
        trainable_params=trainable,
        expert_load_factor=expert_load_factor,
    )
    lines = [
        f"model {shape.model_type}: {shape.total_params / 1e9:.2f} B parameters "
        f"({shape.active_params / 1e9:.2f} B active per token), {shape.layers} layers; {gpus} GPUs "
        f"({hw.gpus_per_node} per node, {gpu_memory / 2**30:.0f} GiB, {hw.memory_headroom:.0%} usable); "
        f"seq {seq_len}"
        + (f"; global batch {global_batch}" if global_batch else "")
        + (f"; {peft}" if peft else "")
        + (f"; expert load factor {expert_load_factor:g}" if shape.is_moe else ""),
        "",
    ]
    if not cands:
        raise ConfigError(
            "--gpus",
            gpus,
            f"no layout fits {gpu_memory / 2**30:.0f} GiB per GPU for this model and --seq-len={seq_len}",
        )
    # every proposed layout passes the pre-launch checks of `recipes validate` / `recipes train`
    admission = admit_layouts(
        cands,
        top=top,
        gpus=gpus,
        hf_config=hf_config,
        model=build_meta_model(hf_config),
        seq_len=seq_len,
        peft=peft,
    )
    best = admission.admitted
    if not best:
        first = admission.refusals[0][1]
        raise ConfigError(
            "--gpus",
            gpus,
            f"no layout that fits passes the checks recipes train runs before launch; first: {first}",
        )
    lines += format_table(best) + [""] + format_memory(best[0])
    if admission.refusals:
        lines += ["", "refused by the checks recipes train runs before launch (recipes validate's messages):"]
        lines += admission.refusal_lines()
    lines += ["", "# paste into the recipe YAML:"]
    lines += yaml_block(best[0], global_batch=global_batch_of(best[0]))
    return best, lines


def _lora_params(hf_config: PretrainedConfig) -> int:
    """Trainable parameters of LoRA with the recipes' default section, on the meta model."""
    model = build_meta_model(hf_config)
    apply_lora(model, section=build_section(PeftSection, {}))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
