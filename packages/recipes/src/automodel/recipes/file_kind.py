"""A JSON file read as an object, with why it cannot be (a `ConfigError` on the YAML key). Why a path
is no readable file is `automodel.data.file_kind`'s (re-exported here for the recipes' callers)."""

from __future__ import annotations

import json
from pathlib import Path

from automodel.data.file_kind import os_error_line, unreadable_file
from automodel.recipes.errors import ConfigError

__all__ = ["os_error_line", "read_json_object", "unreadable_file"]


def read_json_object(path: Path, *, key: str, value: object) -> dict:
    """The JSON object in `path`; a `ConfigError` on `key` naming the file when it cannot be read, is
    not JSON or holds another value (a config.json that transformers would meet as a traceback)."""
    problem = unreadable_file(path)
    if problem is not None:
        raise ConfigError(key, value, f"{path} {problem}")
    try:
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise ConfigError(key, value, f"{path} cannot be read ({os_error_line(e)})") from None
    except ValueError as e:  # not UTF-8 or not JSON
        raise ConfigError(key, value, f"{path} is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(key, value, f"{path} holds a JSON {type(data).__name__}, not an object")
    return data
