"""Which checkpoint tensors fill which model parameter: transformers' own conversion mapping.

transformers 5 models may hold weights in another layout than their checkpoints: experts stacked
into one tensor (Mixtral's per-expert ``w1``/``w3``/``w2`` -> ``experts.gate_up_proj`` /
``down_proj``), renamed modules (GPT-NeoX's ``embed_out``, GraniteMoE's ``input_linear``), fused or
split projections. ``save_pretrained`` writes the checkpoint layout and ``from_pretrained`` maps it
back with the model's conversion mapping (``get_model_conversion_mapping``); loading into sharded
parameters applies the same mapping, key by key, so a model's own ``save_pretrained`` output and the
Hub checkpoints it was written for both load.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)


@dataclass
class ConvertedGroup:
    """Model parameters computed from several checkpoint tensors (or one tensor reshaped) by a
    transformers ``WeightConverter``; `converter` is this group's own copy."""

    converter: Any
    first_target: str
    targets: tuple[str, ...]
    #: converter source pattern -> checkpoint keys in transformers' natural order (expert 0, 1, ...)
    sources: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class KeyPlan:
    """How the checkpoint fills the model: read as is (possibly under another name) or converted."""

    #: model key -> checkpoint key holding exactly that tensor
    renamed: dict[str, str]
    converted: list[ConvertedGroup]

    def covered(self) -> set[str]:
        """Model keys the checkpoint provides."""
        return set(self.renamed) | {t for group in self.converted for t in group.targets}


def find_hf_model(parts: Iterable[nn.Module]) -> Any | None:
    """The outermost transformers `PreTrainedModel` inside the parts (through DDP / FSDP /
    megatron-fsdp wrappers; a pipeline stage's own model), whose class and config select the mapping."""
    for part in parts:
        for module in part.modules():
            model = getattr(module, "causal_lm", module)  # a pipeline stage runs this model's forward
            if isinstance(model, PreTrainedModel):
                return model
    return None


def _mapping_model(hf_model: Any) -> Any:
    """`hf_model`, or a meta-device instance of its original classes where FSDP2 swapped them.

    transformers skips classes defined outside transformers (custom code) when it looks up a
    model's conversion mapping; FSDP2 swaps a sharded module's class for a subclass defined in
    torch, so a sharded model would lose its mapping. The mapping depends only on the classes,
    configs and module paths, which the fresh instance has."""
    if not any(isinstance(m, FSDPModule) and isinstance(m, PreTrainedModel) for m in hf_model.modules()):
        return hf_model
    original = next(c for c in type(hf_model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        return original._from_config(hf_model.config)


def conversion_mapping(hf_model: Any) -> list[Any]:
    """`hf_model`'s transformers conversion mapping (checkpoint layout -> model layout)."""
    return get_model_conversion_mapping(_mapping_model(hf_model))


def to_checkpoint_layout(hf_model: Any | None, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Full tensors under model keys -> the keys and shapes ``save_pretrained`` writes (per-expert
    tensors, original module names), which serving engines and older readers expect. Every
    reverse conversion needs all of its model keys in `state_dict` (one module's, on one writer)."""
    if hf_model is None:
        return state_dict

    return revert_weight_conversion(_mapping_model(hf_model), state_dict)


def plan_keys(hf_model: Any | None, model_keys: Collection[str], checkpoint_keys: Iterable[str]) -> KeyPlan:
    """Map every checkpoint key onto `model_keys` as ``from_pretrained`` would for `hf_model`.

    Checkpoint keys that map to no model key are ignored (another pipeline stage's, or keys the
    model does not use). Without a transformers model only identical names match."""
    model_keys = set(model_keys)
    if hf_model is None:
        return KeyPlan(renamed={k: k for k in checkpoint_keys if k in model_keys}, converted=[])

    mapping = conversion_mapping(hf_model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = hf_model.base_model_prefix
    present = dict.fromkeys(model_keys, True)  # transformers asks `.get(key) is not None`
    renamed: dict[str, str] = {}
    groups: dict[str, ConvertedGroup] = {}
    for key in sorted(checkpoint_keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, present)
        if target not in model_keys and key in model_keys:
            target, pattern = key, None  # the key already names a parameter: read it as is
        if target not in model_keys:
            continue
        if pattern is None:
            renamed[target] = key
            continue
        group = groups.get(target)
        if group is None:
            converter = copy.deepcopy(by_pattern[pattern])
            first = converter.target_patterns[0]
            targets = tuple(target.replace(first, t, 1) for t in converter.target_patterns)
            group = groups[target] = ConvertedGroup(converter=converter, first_target=target, targets=targets)
        group.sources.setdefault(pattern, []).append(key)
    return KeyPlan(renamed=renamed, converted=list(groups.values()))
