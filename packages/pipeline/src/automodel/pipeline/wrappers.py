"""Wrappers a `parallelize_fn` may put around a stage module, seen through where names matter.

`DistributedDataParallel` holds the stage as ``.module`` and `torch.compile` as ``._orig_mod``, so
the wrapped stage names its parameters ``module.h.0.weight``. Tied copies are paired across ranks
by their full-model FQN, and `PipelineModel.named_parameters()` promises full-model FQNs
(checkpoints need no renaming): both read names through the wrappers. Decided by the wrapper's
type, not the atom's spelling: a model's own submodule called ``module`` keeps its name.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def _inner_attr(module: nn.Module) -> str | None:
    """The attribute a wrapper keeps the wrapped module under, or None for a plain module."""
    if isinstance(module, DistributedDataParallel):
        return "module"
    # torch.compile's OptimizedModule, by name: importing torch._dynamo here would cost seconds.
    if type(module).__name__ == "OptimizedModule" and "_orig_mod" in module._modules:
        return "_orig_mod"
    return None


def full_model_name(root: nn.Module, name: str) -> str:
    """`name` (a parameter or module name under `root`) without the atoms of wrappers on its path."""
    kept: list[str] = []
    module: nn.Module | None = root
    for atom in name.split("."):
        if module is not None and _inner_attr(module) == atom:
            module = module._modules[atom]
            continue
        kept.append(atom)
        module = module._modules.get(atom) if module is not None else None
    return ".".join(kept)


def named_parameters_in_model(
    part: nn.Module, *, remove_duplicate: bool = True
) -> Iterator[tuple[str, nn.Parameter]]:
    """`part.named_parameters()` under the parameters' names in the full (unwrapped) model."""
    for name, param in part.named_parameters(remove_duplicate=remove_duplicate):
        yield full_model_name(part, name), param


def unwrap(part: nn.Module) -> nn.Module:
    """The module inside any wrappers around `part` (the stage as the split made it)."""
    while (attr := _inner_attr(part)) is not None:
        inner = part._modules[attr]
        assert inner is not None
        part = inner
    return part
