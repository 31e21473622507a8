"""Where a Hugging Face model keeps its parts: the one home of model introspection.

Every package reads a model's structure here, so they agree on it: the decoder layers (Llama's
``model.layers``, GPT-2's ``transformer.h``, DBRX's ``transformer.blocks``; dense and MoE models
alike), the text decoder's config and the facts read off it (per-layer values, head widths, expert
counts), the names of parameters and modules as the bare model has them (without the atoms that
activation checkpointing, compile, FSDP, DDP and megatron-fsdp wrappers add), the input and output
embeddings, the parameters several modules hold (tied weights), and the sub-models of a multimodal
model that text training never runs.

A Hugging Face multimodal causal LM (Gemma 3, Llama 4, Qwen 3.5, ...) holds its text decoder and
one sub-model per other modality, each a ``PreTrainedModel`` with its own config. The packages that
look for decoder layers or attention modules skip those towers: a tower's layer list or attention
class says nothing about the text decoder. Only torch is imported (transformers is optional).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from automodel.mesh.torch_internals import CHECKPOINT_WRAPPED, COMPILED_ORIGINAL, FSDP1_WRAPPED

#: Module attributes a wrapper adds to the FQNs of what it wraps: torch's checkpoint wrapper, the
#: compiled module (``torch.compile``), FSDP1, and DDP's / megatron-fsdp's ``module``.
WRAPPER_ATOMS = (CHECKPOINT_WRAPPED, COMPILED_ORIGINAL, FSDP1_WRAPPED, "module")


def canonical_fqn(fqn: str) -> str:
    """`fqn` as the bare model names it: every wrapper atom (`WRAPPER_ATOMS`) dropped, wherever it
    sits (a per-layer compile or checkpoint wrapper puts its atom mid-name, DDP at the front). The
    one rule, so that init, checkpoints, the optimizer's rebinding and the layout report agree on
    names (a model's own sub-module called ``module`` is read as a wrapper too)."""
    return ".".join(a for a in fqn.split(".") if a not in WRAPPER_ATOMS)


def text_config(config: object) -> Any:
    """The config of the text decoder: a multimodal model's ``text_config`` (its layers, heads and
    vocabulary), else `config` itself (None stays None)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def model_text_config(model: nn.Module) -> Any:
    """`text_config` of the model's ``config`` (None for a model without one)."""
    return text_config(getattr(model, "config", None))


def layer_values(config: object, key: str) -> list[Any]:
    """`key` of every decoder layer for an attribute that varies across layers, else its one global
    value (None where the config lacks it).

    A heterogeneous config (transformers' ``per_layer_config``: Gemma 4's wider full-attention
    heads, per-layer head counts) has no single value of the attributes that vary across its layers,
    and transformers raises when one is read globally: they are read here, one value per layer.
    """
    layers = getattr(config, "per_layer_config", None)
    if layers is not None and key in (getattr(config, "per_layer_attributes", None) or ()):
        return [getattr(layer, key, None) for layer in layers]
    return [getattr(config, key, None)]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def positive_ints(config: object, key: str) -> list[int]:
    """The distinct positive int values `key` takes over the layers, ascending (empty if unset)."""
    return sorted({v for v in layer_values(config, key) if _positive_int(v)})


def head_dims(config: object) -> list[int]:
    """Every attention head width the layers use (``head_dim``, else hidden_size / heads)."""
    dims = positive_ints(config, "head_dim")
    if dims:
        return dims
    hidden = getattr(config, "hidden_size", 0) or 0
    return sorted({hidden // heads for heads in positive_ints(config, "num_attention_heads") if hidden})


#: transformers' config base class, by name: ``PreTrainedConfig`` in transformers 5, whose
#: ``PretrainedConfig`` is an alias of it (the class name of transformers 4).
_HF_CONFIG_CLASSES = ("PreTrainedConfig", "PretrainedConfig")


def _is_hf_config(value: Any) -> bool:
    """A transformers config (by class name: transformers is optional here)."""
    return any(c.__name__ in _HF_CONFIG_CLASSES for c in type(value).__mro__)


def config_int(config: object, keys: tuple[str, ...]) -> int | None:
    """The first positive int of `keys` in the config, else in a part config holding it (DBRX's
    ``ffn_config``)."""
    for key in keys:
        value = getattr(config, key, None)
        if _positive_int(value):
            return value
    for part in vars(config).values():
        if _is_hf_config(part) and (value := config_int(part, keys)):
            return value
    return None


def num_experts(config: object) -> int | None:
    """Routed experts per MoE layer; None for a dense model."""
    return config_int(config, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"))


def experts_per_token(config: object) -> int | None:
    """Routed experts each token goes to (top-k); None where the config does not say."""
    return config_int(
        config, ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "moe_topk", "top_k")
    )


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
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
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
