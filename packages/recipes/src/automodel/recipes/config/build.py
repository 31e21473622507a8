"""Parsing helpers of the config layer: YAML value types against a section's field hints, dtype
names. Pure functions of their arguments (no imports of behaviour, no I/O)."""

from __future__ import annotations

import copy
import types
import typing
from dataclasses import fields
from typing import Any, TypeVar

import torch

from automodel.mesh import DTYPE_NAMES, parse_dtype
from automodel.recipes.errors import ConfigError, reject_unknown

S = TypeVar("S")


def resolve_dtype(key: str, value: object) -> torch.dtype:
    """`parse_dtype` with the failure as a `ConfigError` naming the YAML key."""
    try:
        dtype = parse_dtype(value, key=key)
    except ValueError:
        raise ConfigError(key, value, f"must be a dtype name ({', '.join(DTYPE_NAMES)})") from None
    if dtype is None:
        raise ConfigError(key, value, f"must be a dtype name ({', '.join(DTYPE_NAMES)})")
    return dtype


def derived(section: S, **changes: object) -> S:
    """A copy of a built section with values resolved after parsing (a Hub id's local directory, a
    default cache folder). Not re-validated as YAML: the YAML-level rules (an alias given twice, a
    blend next to paths) would refuse the resolved form. The original is left as it was."""
    new = copy.copy(section)
    for name, value in changes.items():
        object.__setattr__(new, name, value)
    return new


def _check_field(key: str, value: Any, hint: Any) -> None:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                _check_field(key, value, opt)
                return
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if errors else ConfigError(key, value, "must not be null")
    if origin is not None:
        hint = origin
    if hint is Any:
        return
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        name = {
            int: "an int",
            float: "a number",
            bool: "true or false",
            str: "a string",
            dict: "a mapping",
            list: "a list",
        }
        raise ConfigError(key, value, f"must be {name.get(hint, hint.__name__)}")


def build_section(cls: type[S], data: object) -> S:
    """Check `data`'s keys and value types against `cls`'s fields, then construct it."""
    section: str = cls.SECTION  # pyright: ignore[reportAttributeAccessIssue]
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(section, data, "must be a mapping of keys")
    names = {f.name for f in fields(cls) if f.init}
    reject_unknown(section, data, names)
    hints = typing.get_type_hints(cls)
    for k, v in data.items():
        _check_field(f"{section}.{k}", v, hints[k])
    return cls(**data)


def positive(section: str, name: str, value: Any, *, allow_none: bool = False, minimum: float = 1) -> None:
    if value is None and allow_none:
        return
    if value is None or value < minimum:
        raise ConfigError(f"{section}.{name}", value, f"must be >= {minimum}")
