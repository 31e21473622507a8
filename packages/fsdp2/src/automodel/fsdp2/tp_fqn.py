"""How a TP plan key names modules: torch's matching rule, and where the decoder layers sit."""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from automodel.mesh.model_parts import find_layer_list


def fqn_matches(pattern: str, fqn: str) -> bool:
    """parallelize_module's matching rule: same number of atoms, fnmatch atom by atom."""
    pat, name = pattern.split("."), fqn.split(".")
    return len(pat) == len(name) and all(fnmatch.fnmatch(n, p) for p, n in zip(pat, name))


def resolves_to_parameter(model: nn.Module, key: str) -> bool:
    """Whether `key` names a parameter rather than a module (HF plans have such keys; torch cannot apply them)."""
    names = [n for n, _ in model.named_parameters()]
    return any(fqn_matches(key, n) for n in names) and not any(
        fqn_matches(key, n) for n, _ in model.named_modules()
    )


def removed_by_split(model: nn.Module, pattern: str) -> bool:
    """Whether `pattern` leads through a module slot a pipeline split emptied (set to None, as
    the stages before the last hold ``lm_head`` and the final norm): that key names a module
    another stage holds, not a typo."""
    node: Any = model
    for atom in pattern.split("."):
        if any(c in atom for c in "*?["):
            return False
        child = getattr(node, atom, None)
        if child is None and atom not in vars(node) and hasattr(node, atom):
            return True  # a registered slot holding None (nn.Module.__getattr__ answers it)
        if not isinstance(child, nn.Module):
            return False
        node = child
    return False


def decoder_layers_prefix(model: nn.Module) -> tuple[str, nn.Module] | None:
    """FQN and first element of the decoder-layer ModuleList (`find_layer_list`: ``model.layers``,
    GPT-2's ``transformer.h``; a pipeline stage may hold layers "2", "3" only)."""
    found = find_layer_list(model)
    return None if found is None else (found[0], next(iter(found[1])))
