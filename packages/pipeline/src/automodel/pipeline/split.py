"""Cut a module into stages by module FQN lists, keeping every parameter's original FQN.

A stage is a pruned shallow copy of the model: the modules named for that stage (and the
containers on the path to them) stay, everything else is removed (set to None, or deleted from a
ModuleList/ModuleDict without renumbering). Kept modules are shared with the model, not copied,
so splitting a materialized model costs no extra memory; a module kept by several stages (a
parameter-free rotary embedding, say) is deep-copied so stages stay independent. The model's
own `forward` runs the stage, so it must tolerate removed modules (torchtitan style); Hugging
Face causal LMs get a stage forward of their own (see `hf.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence

from torch import nn

from automodel.mesh.model_parts import parameter_places

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class PipelineSplitError(ValueError):
    """The model cannot be split into pipeline stages generically; the message says why."""


def is_transformers_model(model: nn.Module) -> bool:
    """Decided by class, not by a ``.config`` attribute (torchtitan and nanoGPT models have one too)."""
    return any(c.__module__.split(".")[0] == "transformers" for c in type(model).__mro__)


def is_within(fqn: str, roots: list[str] | tuple[str, ...]) -> bool:
    """Whether `fqn` is one of `roots` or a submodule of one."""
    return any(fqn == r or fqn.startswith(r + ".") for r in roots)


def _shallow_clone(module: nn.Module) -> nn.Module:
    """A copy whose own registries (modules, params, buffers, hooks) are new dicts, sharing values."""
    clone = copy.copy(module)
    clone.__dict__ = {
        k: (copy.copy(v) if isinstance(v, dict | set) else v) for k, v in module.__dict__.items()
    }
    return clone


def _prune(module: nn.Module, keep: set[str], copy_fqns: set[str], prefix: str) -> nn.Module:
    if prefix in keep:
        return copy.deepcopy(module) if prefix in copy_fqns else module
    clone = _shallow_clone(module)
    for name, child in module._modules.items():
        fqn = f"{prefix}.{name}" if prefix else name
        needed = child is not None and (fqn in keep or any(k.startswith(fqn + ".") for k in keep))
        if needed:
            clone._modules[name] = _prune(child, keep, copy_fqns, fqn)
        elif isinstance(module, _CONTAINERS):
            del clone._modules[name]  # keeps the other keys (original layer indices) as they were
        else:
            clone._modules[name] = None
    return clone


def check_fqns_exist(model: nn.Module, fqns_per_stage: Sequence[Sequence[str]]) -> None:
    """Every named module must exist in `model`."""
    names = {name for name, _ in model.named_modules()}
    for i, fqns in enumerate(fqns_per_stage):
        for fqn in fqns:
            if fqn not in names or fqn == "":
                top = ", ".join(n for n, _ in model.named_children())
                raise ValueError(
                    f"module_fqns_per_model_part[{i}] names {fqn!r}, which is not a submodule of "
                    f"{type(model).__name__} (its top-level modules: {top})"
                )


def split_module(model: nn.Module, *, fqns: Sequence[str], shared_fqns: Sequence[str] = ()) -> nn.Module:
    """The stage of `model` that holds the modules `fqns` (parameter FQNs unchanged).

    Modules in `shared_fqns` (kept by more than one stage) are deep-copied instead of shared. A
    parameter the model holds in several modules (tied weights) stays one parameter in the stage.
    """
    stage = _prune(model, set(fqns), set(shared_fqns), "")
    _retie(stage, model)
    return stage


def _retie(stage: nn.Module, model: nn.Module) -> None:
    """Where `model` holds one parameter in several modules, make the stage's copies one object."""
    for places in parameter_places(model).values():
        if len(places) < 2:
            continue
        present = []
        for mod_name, attr in places:
            try:
                module = stage.get_submodule(mod_name)
            except AttributeError:
                continue
            if module is not None and module._parameters.get(attr) is not None:
                present.append((module, attr))
        if len(present) > 1:
            first = present[0][0]._parameters[present[0][1]]
            for module, attr in present[1:]:
                module._parameters[attr] = first


def modules_in_several_stages(fqns_per_stage: Sequence[Sequence[str]]) -> set[str]:
    """Named modules that another stage also holds, itself or inside a module it names (the last
    stage's word embeddings inside the first stage's ``bert.embeddings``): these are copied."""
    found = set()
    for stage, fqns in enumerate(fqns_per_stage):
        others = [f for s, other in enumerate(fqns_per_stage) if s != stage for f in other]
        found |= {fqn for fqn in fqns if any(fqn == o or fqn.startswith(o + ".") for o in others)}
    return found


def check_parameter_coverage(
    model: nn.Module, fqns_per_stage: Sequence[Sequence[str]], *, shared_ok: Collection[str] = ()
) -> None:
    """Each parameter of `model` must land in exactly one stage (none lost, none duplicated), except
    the parameters named in `shared_ok` (tied weights whose gradients the pipeline synchronises)."""
    check_fqns_exist(model, fqns_per_stage)
    owner: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
        owner.setdefault(id(p), [])
    for stage, fqns in enumerate(fqns_per_stage):
        pruned = _prune(model, set(fqns), set(), "")
        for p in pruned.parameters():
            owner[id(p)].append(stage)
    missing = [names[k] for k, stages in owner.items() if not stages]
    if missing:
        raise ValueError(
            f"parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} are in no pipeline stage; "
            "add their modules to module_fqns_per_model_part"
        )
    doubled = {
        names[k]: stages for k, stages in owner.items() if len(stages) > 1 and names[k] not in shared_ok
    }
    if doubled:
        first = dict(list(doubled.items())[:5])
        raise ValueError(
            f"parameters are in more than one pipeline stage (name: stages) {first}; each parameter must "
            "belong to exactly one stage (tied weights cannot be pipelined)"
        )
