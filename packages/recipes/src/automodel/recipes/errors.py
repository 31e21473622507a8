"""`ConfigError` (a user mistake in the recipe config) and `DataError` (an unusable data file or row):
reported as one line and exit code 2, like every `ValueError` the project raises on purpose
(`is_user_error`)."""

from __future__ import annotations

import dis
from types import CodeType

from automodel.data.errors import ConfigError, DataError

# The typed errors live in automodel-data (which cannot import recipes); recipes raises the same classes.
__all__ = [
    "ConfigError",
    "DataError",
    "is_user_error",
    "reject_unknown",
    "require_positive_int",
    "require_type",
]


def require_type(key: str, value: object, types: type | tuple[type, ...], what: str) -> None:
    """Raise `ConfigError` unless `value` is an instance of `types` (bools are never ints)."""
    allowed = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in allowed:
        raise ConfigError(key, value, f"must be {what}")
    if not isinstance(value, allowed):
        raise ConfigError(key, value, f"must be {what}, got {type(value).__name__}")


def require_positive_int(key: str, value: object, *, minimum: int = 1) -> None:
    require_type(key, value, int, "an int")
    if isinstance(value, int) and value < minimum:  # an int: require_type raised otherwise
        raise ConfigError(key, value, f"must be >= {minimum}")


def reject_unknown(section: str, data: dict, known: set[str] | tuple[str, ...]) -> None:
    """Unknown keys are typos more often than intent: reject them by name."""
    for key in data:
        if key not in known:
            raise ConfigError(
                f"{section}.{key}" if section else key,
                data[key],
                f"unknown key; known keys: {', '.join(sorted(known))}",
            )


#: Modules whose own ``raise ValueError(...)`` refuses the user's input (every automodel package).
PROJECT_MODULE_PREFIX = "automodel."


def is_user_error(exc: BaseException) -> bool:
    """Whether `exc` is a user mistake, printed as one line with exit code 2 (no traceback).

    `ConfigError` and `DataError` always are. So is any other `ValueError` that automodel code raised
    itself: the project's rule is that its ``raise ValueError(...)`` refuses bad input (sizes, layouts,
    model directories), and the sibling packages (mesh, fsdp2, pipeline, ...) cannot import
    `ConfigError`. "Raised itself" is read from the traceback, so no raise site needs editing: the
    innermost frame is in an ``automodel.`` module and stopped on a ``raise <exception>`` instruction.
    A ValueError raised inside torch or another library (its innermost frame is theirs), a builtin's
    ValueError surfacing in our code (``int("x")``, an unpacking: the frame stopped on a call, not a
    raise) and a caught library error re-raised by name (its traceback still ends in the library)
    stay bugs, with their traceback.
    """
    if isinstance(exc, ConfigError | DataError):
        return True
    if not isinstance(exc, ValueError) or exc.__traceback__ is None:
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__")
    if not isinstance(module, str) or not module.startswith(PROJECT_MODULE_PREFIX):
        return False
    return _raises_at(tb.tb_frame.f_code, tb.tb_lasti)


def _raises_at(code: CodeType, offset: int) -> bool:
    """The instruction at `offset` of `code` is ``raise X`` / ``raise X from Y`` (not a bare re-raise)."""
    for instruction in dis.get_instructions(code):
        if instruction.offset == offset:
            return instruction.opname == "RAISE_VARARGS" and (instruction.arg or 0) >= 1
    return False
