"""Inputs a model's forward needs that the recipes do not pass: their defaults must come from the config.

The training loop calls the model with token ids and position ids only. A model that selects
weights by another input falls back to a config field when that input is absent; with the field
unset its forward raises inside every rank. Each rule below names the input, the config field
and the field listing its accepted values, so the run is refused before launch naming the key.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from automodel.recipes.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from automodel.recipes.config.sections import ModelSection


@dataclass(frozen=True)
class DefaultedInput:
    """A forward input (`name`) the model replaces by ``config.<field>`` (one of ``config.<choices>``)."""

    name: str
    field: str
    choices: str


#: X-MOD picks its language adapters by ``lang_ids``, else by ``config.default_language``.
RULES: tuple[DefaultedInput, ...] = (DefaultedInput("lang_ids", "default_language", "languages"),)


def check_defaulted_inputs(hf_config: PretrainedConfig, *, model_cls: type, section: ModelSection) -> None:
    """`ConfigError` naming the config field when `model_cls.forward` takes an input the recipes do
    not pass and the field it falls back to is unset or not one of its accepted values."""
    try:
        params = inspect.signature(model_cls.forward).parameters
    except (TypeError, ValueError):
        return
    for rule in RULES:
        if rule.name not in params or not hasattr(hf_config, rule.field):
            continue
        value = getattr(hf_config, rule.field)
        choices = list(getattr(hf_config, rule.choices, None) or [])
        if value is not None and (not choices or value in choices):
            continue
        where = (
            f"model.config.{rule.field}"
            if section.config is not None
            else f"{section.pretrained_key} (config.json field {rule.field})"
        )
        listed = f"one of config.{rule.choices} {choices}" if choices else "a value"
        raise ConfigError(
            where,
            value,
            f"must be set to {listed}: model_type {hf_config.model_type!r} takes `{rule.name}` in its "
            f"forward, which training does not pass, and uses {rule.field} instead",
        )


def position_id_offset(model: Any) -> int:
    """What the model adds to 0-based positions before its learned position table.

    The recipes pass ``position_ids`` counting from 0 (from 0 again at each packed document). A
    table declared with a ``padding_idx`` (RoBERTa and its relatives) reserves the rows up to it:
    the model's own positions start at ``padding_idx + 1``, so the ids it is given are shifted by as
    much; passing 0-based ids trained it on the wrong rows (6e-4..2e-3 off transformers' loss).
    """
    offsets = {
        module.padding_idx + 1
        for name, module in model.named_modules()
        if name.rpartition(".")[2] == "position_embeddings"
        and isinstance(module, nn.Embedding)
        and module.padding_idx is not None
    }
    if len(offsets) > 1:
        raise ValueError(f"position tables with different padding rows {sorted(offsets)}: no single offset")
    return offsets.pop() if offsets else 0
