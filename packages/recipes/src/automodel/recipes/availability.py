"""Look up a sibling package's API lazily; a missing one is a config error, never a silent fallback."""

from __future__ import annotations

import importlib
from typing import Any

from automodel.recipes.errors import ConfigError


def has_api(module: str, *names: str) -> bool:
    """True when `module` imports and defines every one of `names`."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False
    return all(hasattr(mod, n) for n in names)


def require_api(module: str, *names: str, key: str, value: object) -> tuple[Any, ...]:
    """The named attributes of `module`, or `ConfigError` saying the layout is not available yet."""
    if not has_api(module, *names):
        raise ConfigError(
            key, value, f"needs {module}.{', '.join(names)}, which is not available yet in this installation"
        )
    mod = importlib.import_module(module)
    return tuple(getattr(mod, n) for n in names)
