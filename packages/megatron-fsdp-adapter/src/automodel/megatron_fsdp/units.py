"""Which module classes become Megatron-FSDP units (sharded, gathered and freed together)."""

from __future__ import annotations

import importlib

from torch import nn


def resolve_unit_modules(model: nn.Module, names: list[str] | None = None) -> list[type[nn.Module]]:
    """Classes for `names` (class names found in `model`, or ``pkg.mod.Class`` import paths).

    ``names=None`` uses the model's ``_no_split_modules`` (Hugging Face's list of blocks that
    must stay whole), which is exactly the granularity FSDP units want: one decoder layer each.
    """
    key = "megatron_fsdp_unit_modules"
    if names is None:
        key = f"{type(model).__name__}._no_split_modules"
        names = list(getattr(model, "_no_split_modules", None) or [])
        if not names:
            raise ValueError(
                f"{type(model).__name__} has no _no_split_modules; set megatron_fsdp_unit_modules "
                "to the class names of its repeated blocks (e.g. ['LlamaDecoderLayer'])"
            )
    in_model = {type(m).__name__: type(m) for m in model.modules()}
    classes: list[type[nn.Module]] = []
    for name in names:
        cls = in_model.get(name) or _import_class(name)
        if cls is None:
            raise ValueError(
                f"{key}: {name!r} is neither a module class used in {type(model).__name__} nor an "
                f"importable 'package.module.Class' path; classes in the model: {sorted(in_model)}"
            )
        if cls not in classes:
            classes.append(cls)
    return classes


def _import_class(path: str) -> type[nn.Module] | None:
    module_name, _, cls_name = path.rpartition(".")
    if not module_name:
        return None
    try:
        cls = getattr(importlib.import_module(module_name), cls_name, None)
    except ImportError:
        return None
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) else None
