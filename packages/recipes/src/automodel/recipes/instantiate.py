"""`_target_` instantiation: dotted paths become objects, `*_fn` keys stay uncalled callables."""

from __future__ import annotations

import importlib
from typing import Any

from automodel.recipes.config.build import resolve_dtype
from automodel.recipes.errors import ConfigError


def locate(key: str, dotted: Any) -> Any:
    """Import `package.module.attr` (longest importable module prefix, then attributes)."""
    if not isinstance(dotted, str) or not dotted or dotted.startswith(".") or " " in dotted:
        raise ConfigError(key, dotted, "must be a dotted import path like torch.optim.AdamW")
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ConfigError(key, dotted, "cannot be imported")


def instantiate(node: Any, *, key: str, **extra: Any) -> Any:
    """Build `node`: mappings with `_target_` are called with their (instantiated) other keys.

    Keys ending in ``_fn`` are resolved to the callable they name but not called, so a config can
    pass functions (loss_fn, parallelize_fn, ...). Keys ending in ``dtype`` accept dtype names.
    `extra` keyword arguments go to the top-level call only (e.g. the optimizer's params).
    """
    if isinstance(node, dict):
        kwargs = {k: _instantiate_value(f"{key}.{k}", k, v) for k, v in node.items() if k != "_target_"}
        if "_target_" not in node:
            if extra:
                raise ConfigError(key, node, "needs a _target_ to be instantiated")
            return kwargs
        target = locate(f"{key}._target_", node["_target_"])
        if not callable(target):
            raise ConfigError(f"{key}._target_", node["_target_"], "is not callable")
        try:
            return target(**kwargs, **extra)
        except TypeError as e:
            raise ConfigError(key, node["_target_"], f"cannot be called with these keys ({e})") from None
    if isinstance(node, list):
        return [instantiate(v, key=f"{key}[{i}]") for i, v in enumerate(node)]
    return node


def _instantiate_value(key: str, name: str, value: Any) -> Any:
    if name.endswith("_fn"):
        if isinstance(value, str):
            return locate(key, value)
        if isinstance(value, dict) and set(value) == {"_target_"}:
            return locate(f"{key}._target_", value["_target_"])
    if name.endswith("dtype") and isinstance(value, str):
        return resolve_dtype(key, value)
    return instantiate(value, key=key)
