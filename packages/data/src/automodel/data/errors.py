"""The package's typed errors: `ConfigError` (a bad value in a section) and `DataError` (an unusable
data file or row), both `ValueError`s whose `str()` is one line naming the key or the file; and
`MissingExtraError` when a source needs an optional dependency that is not installed.

A command-line front end prints them as one line and exits 2 (automodel-recipes' CLI does); a plain
training loop may catch them like any `ValueError`.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class ConfigError(ValueError):
    """A config key holds a bad value; `str()` is the one line a CLI prints."""

    def __init__(self, key: str, value: object, message: str) -> None:
        self.key = key
        self.value = value
        self.message = message
        super().__init__(f"{key}={value!r}: {message}")

    def __reduce__(self) -> tuple:  # picklable: raised in worker processes, re-raised in the parent
        return (type(self), (self.key, self.value, self.message))


class DataError(ValueError):
    """A data file or row is unusable; `str()` names the file (and line or row) and what is wrong."""


#: optional module -> the extra of automodel-data that installs it
EXTRAS = {
    "transformers": "hf",
    "jinja2": "hf",
    "huggingface_hub": "hf",
    "pyarrow": "arrow",
    "datasets": "datasets",
    "tqdm": "datasets",
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; `str()` says which extra installs it."""

    def __init__(self, module: str, *, needed_for: str) -> None:
        self.module = module
        self.extra = EXTRAS.get(module.split(".")[0], "all")
        super().__init__(
            f"{needed_for} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'automodel-data[{self.extra}]'"
        )


def optional(module: str, *, needed_for: str) -> ModuleType:
    """`module`, imported on first use (an extra of this package), or `MissingExtraError`."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.split(".")[0] != e.name.split(".")[0]:
            raise  # the extra is installed but broken: its own traceback
        raise MissingExtraError(module, needed_for=needed_for) from None
