"""``peft.initial_adapter``: start LoRA from an existing adapter instead of a fresh draw.

The directory is Hugging Face PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``,
keys ``base_model.model.<linear FQN>.lora_A.weight`` / ``lora_B.weight``), which peft and this
project's own runs (``checkpoints/step_N/adapter``) write, as does the AutoModel benchmark's dump of
AutoModel's initial adapter (``benchmarks/_automodel_initial_adapter.py``). Its ``r`` and ``lora_alpha`` must be
the run's ``peft.dim`` and ``peft.alpha`` and its tensors exactly the adapters the run's ``peft``
section selects, with their shapes: anything else would train another model than the YAML says, so
it is refused by name (before launch: `check_initial_adapter`; in the ranks: `read_initial_adapter`).
Both ``lora_A`` and ``lora_B`` are taken as they are (a trained adapter continues from where it was).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from automodel.mesh.model_parts import canonical_fqn
from automodel.recipes.config.peft import PeftSection
from automodel.recipes.errors import ConfigError
from automodel.recipes.peft.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from automodel.recipes.peft.lora import is_adapter_key

KEY = "peft.initial_adapter"
#: adapter_config.json fields that would change the adapter's math if set, and their neutral value.
UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False}


def _read_config(directory: Path) -> dict:
    if not directory.is_dir():
        raise ConfigError(KEY, str(directory), "is not a local directory")
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (directory / f).is_file()]
    if missing:
        raise ConfigError(
            KEY, str(directory), f"has no {' or '.join(missing)} (a Hugging Face PEFT adapter directory)"
        )
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(KEY, str(directory), f"{ADAPTER_CONFIG} is not readable JSON ({e})") from e
    if not isinstance(config, dict):
        raise ConfigError(KEY, str(directory), f"{ADAPTER_CONFIG} is not a JSON object")
    return config


def check_adapter_config(section: PeftSection, directory: Path) -> None:
    """``adapter_config.json`` describes LoRA with the section's rank and alpha (ConfigError otherwise)."""
    config = _read_config(directory)
    where = f"{directory / ADAPTER_CONFIG}"
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(KEY, str(directory), f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    for field, neutral in UNSUPPORTED.items():
        if config.get(field, neutral) != neutral:
            raise ConfigError(
                KEY, str(directory), f"{where}: {field}={config[field]!r} is not supported here"
            )
    for field, key, want in (("r", "peft.dim", section.dim), ("lora_alpha", "peft.alpha", section.alpha)):
        got = config.get(field)
        if got is None or isinstance(got, bool) or not isinstance(got, int | float) or got != want:
            raise ConfigError(
                KEY,
                str(directory),
                f"{where}: {field}={got!r}, but this run's {key}={want} (they must be equal)",
            )


def _file_shapes(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The file's key and shape of each tensor by the model's FQN (``base_model.model.`` dropped), header only."""
    path = directory / ADAPTER_WEIGHTS
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise ConfigError(
            KEY, str(directory), f"{ADAPTER_WEIGHTS} is not a readable safetensors file ({e})"
        ) from e
    return {k.removeprefix(PEFT_PREFIX): (k, s) for k, s in shapes.items()}


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every adapter weight of `model` (after `apply_lora`; meta, wrapped or sharded: DTensors
    report their full shape) by its bare model's FQN, and its full shape."""
    return {canonical_fqn(n): tuple(p.shape) for n, p in model.named_parameters() if is_adapter_key(n)}


def check_adapter_tensors(
    directory: Path, expected: Mapping[str, tuple[int, ...]], *, complete: bool = True
) -> dict[str, str]:
    """The file holds the `expected` adapter weights with their shapes, and (`complete`) no others.

    `complete=False` in a rank whose model parts are one pipeline stage's: the file holds every
    stage's adapters, and the launcher checked it against the whole model already. Returns the
    file's key of each expected FQN."""
    found = _file_shapes(directory)
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected)) if complete else []
    if missing or extra:
        what = (
            f"has no {PEFT_PREFIX}{missing[0]} (and {len(missing) - 1} more adapters this run's peft section selects)"
            if missing
            else f"holds {extra[0]} (and {len(extra) - 1} more), which this run's peft section does not select"
        )
        raise ConfigError(KEY, str(directory), f"{ADAPTER_WEIGHTS} {what}")
    for name, shape in expected.items():
        if found[name][1] != shape:
            raise ConfigError(
                KEY,
                str(directory),
                f"{ADAPTER_WEIGHTS}: {name} has shape {list(found[name][1])}, the run's {list(shape)}",
            )
    return {name: found[name][0] for name in expected}


def check_initial_adapter(section: PeftSection, model: nn.Module) -> None:
    """Before launch: the directory, its config and its tensors against `model` (meta, LoRA applied)."""
    if section.initial_adapter is None:
        return
    directory = Path(section.initial_adapter)
    check_adapter_config(section, directory)
    check_adapter_tensors(directory, expected_shapes(model))


def read_initial_adapter(section: PeftSection, model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """In a rank: the adapter weights of `model_parts` by FQN (CPU, the file's dtype), checked."""
    assert section.initial_adapter is not None
    directory = Path(section.initial_adapter)
    expected: dict[str, tuple[int, ...]] = {}
    for part in model_parts:
        expected.update(expected_shapes(part))
    check_adapter_config(section, directory)
    keys = check_adapter_tensors(directory, expected, complete=False)
    with safe_open(str(directory / ADAPTER_WEIGHTS), framework="pt") as f:
        return {name: f.get_tensor(key) for name, key in keys.items()}
