"""Where a Hugging Face model keeps its parts: the one home of model introspection.

Every package reads a model's structure here, so they agree on it: the decoder layers (Llama's
``model.layers``, GPT-2's ``transformer.h``, DBRX's ``transformer.blocks``), the text decoder's
config, the input and output embeddings, the parameters several modules hold (tied weights), and
the sub-models of a multimodal model that text training never runs.

A Hugging Face multimodal causal LM (Gemma 3, Llama 4, Qwen 3.5, ...) holds its text decoder and
one sub-model per other modality, each a ``PreTrainedModel`` with its own config. The packages that
look for decoder layers or attention modules skip those towers: a tower's layer list or attention
class says nothing about the text decoder. Only torch is imported (transformers is optional).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


def text_config(config: Any) -> Any:
    """The config of the text decoder: a multimodal model's ``text_config`` (its layers, heads and
    vocabulary), else `config` itself (None stays None)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def model_text_config(model: nn.Module) -> Any:
    """`text_config` of the model's ``config`` (None for a model without one)."""
    return text_config(getattr(model, "config", None))


def other_submodel_prefixes(model: nn.Module) -> tuple[str, ...]:
    """FQN prefixes (with the trailing dot) of the sub-models of `model` whose config is neither
    the model's own nor its text decoder's; empty for a text-only model."""
    top = getattr(model, "config", None)
    if top is None:
        return ()
    text = text_config(top)
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


def find_layer_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """FQN and ModuleList of the decoder layers; None if the model has none.

    The shallowest ModuleList of ``num_hidden_layers`` modules of one class; else the shallowest
    list of that length mixing classes (hybrid models build their attention and linear-attention
    layers from two classes, OLMo-Hybrid); else, or without that config field (or on a pipeline
    stage, which holds some layers), the shallowest list of one class (the longest without the
    field). Names do not matter (``layers``, ``h``, ``blocks``). A multimodal model's vision and
    audio towers are not searched.
    """
    expected = getattr(model_text_config(model), "num_hidden_layers", None)
    towers = other_submodel_prefixes(model)
    uniform, mixed = [], []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0 or not name:
            continue
        if in_other_submodel(name, towers):
            continue
        if not any(True for _ in module.parameters()):
            continue
        one_class = len({type(m) for m in module}) == 1
        (uniform if one_class else mixed).append((name.count("."), -len(module), name, module))
    candidates = uniform
    if expected is not None:
        # Rule: a list of exactly num_hidden_layers wins over lists of other lengths; mixed classes
        # only when no list of one class has that length.
        matching = [c for c in uniform if -c[1] == expected] or [c for c in mixed if -c[1] == expected]
        candidates = matching or uniform
    if not candidates:
        return None
    _, _, name, module = min(candidates, key=lambda c: (c[0], c[1]) if expected else (c[1], c[0]))
    return name, module


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers `find_layer_list` finds, in order (a pipeline stage's: those it holds);
    empty for a model without a layer list."""
    found = find_layer_list(model)
    return [] if found is None else [m for m in found[1] if m is not None]


def _hf_method(model: nn.Module, name: str) -> Callable[[], nn.Module | None]:
    """``model.<name>``: a method of the model's class (torch types every Module attribute it does
    not declare as ``Tensor | Module``); AttributeError where the model has none."""
    return getattr(model, name)


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's token embedding module; None for models that do not expose one."""
    try:
        return _hf_method(model, "get_input_embeddings")()
    except (AttributeError, NotImplementedError):
        return None


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's LM head (``get_output_embeddings()``); None for models without one."""
    try:
        head = _hf_method(model, "get_output_embeddings")()
    except (AttributeError, NotImplementedError):
        return None
    return head if isinstance(head, nn.Module) else None


def parameter_places(model: nn.Module) -> dict[int, list[tuple[str, str]]]:
    """Every place each parameter is held, by ``id``: (module FQN, attribute name), over every name
    a module has (a module registered twice is listed under both names). The one walk behind the
    tied-weight questions: a parameter with several places is tied (or in a shared module)."""
    places: dict[int, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((mod_name, attr))
    return places


def tied_weight_modules(model: nn.Module) -> set[str]:
    """FQNs of modules that hold a parameter another module holds too (tied input/output embeddings).

    A module registered under several names (one block shared by several layers) is one module,
    named by its first name: its parameters are not tied by that. Read off the instance, so it
    covers any architecture's ties.
    """
    first_name: dict[int, str] = {}
    for name, module in model.named_modules():
        first_name.setdefault(id(module), name)
    tied: set[str] = set()
    for places in parameter_places(model).values():
        holders = {first_name[id(model.get_submodule(m))] for m, _ in places}
        if len(holders) > 1:
            tied |= holders
    return tied
