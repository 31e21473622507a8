"""Import helpers: YAML names classes, plans and policies by dotted path."""

from __future__ import annotations

import importlib
from typing import Any


def import_class_from_path(name: str) -> Any:
    """Import an object from a dotted path such as ``"torch.optim.AdamW"``.

    The last component may be any attribute of the module (a class, function or dict).
    """
    if not isinstance(name, str) or "." not in name:
        raise ValueError(f"import path must be a dotted string like 'pkg.module.Name', got {name!r}")
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} of path {name!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (path {name!r})") from e


def import_classes_from_paths(class_paths: list[str]) -> list[Any]:
    """`import_class_from_path` for each path, in order."""
    return [import_class_from_path(p) for p in class_paths]
