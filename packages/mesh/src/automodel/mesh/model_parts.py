"""The parts of a multimodal model that are other models (vision and audio towers).

A Hugging Face multimodal causal LM (Gemma 3, Llama 4, Qwen 3.5, ...) holds its text decoder and
one sub-model per other modality, each a ``PreTrainedModel`` with its own config. Text training
never runs the towers, so the packages that look for decoder layers or attention modules skip
them: a tower's layer list or attention class says nothing about the text decoder.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def other_submodel_prefixes(model: nn.Module) -> tuple[str, ...]:
    """FQN prefixes (with the trailing dot) of the sub-models of `model` whose config is neither
    the model's own nor its text decoder's; empty for a text-only model."""
    top = getattr(model, "config", None)
    if top is None:
        return ()
    get_text = getattr(top, "get_text_config", None)
    text = get_text(decoder=True) if callable(get_text) else top
    found: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(p) for p in found):
            continue
        config: Any = getattr(module, "config", None)
        # a sub-model: a PreTrainedModel (it names its config class) with a config of its own
        if (
            hasattr(type(module), "config_class")
            and config is not None
            and config is not top
            and config is not text
        ):
            found.append(f"{name}.")
    return tuple(found)


def in_other_submodel(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether the module named `name` lies inside one of `prefixes` (see `other_submodel_prefixes`)."""
    return any(f"{name}.".startswith(p) for p in prefixes)
