"""`ConfigError` (a user mistake in the recipe config) and `DataError` (an unusable data file or row):
reported as one line and exit code 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config key holds a bad value; `str()` is the one line the CLI prints."""

    def __init__(self, key: str, value: object, message: str) -> None:
        self.key = key
        self.value = value
        self.message = message
        super().__init__(f"{key}={value!r}: {message}")

    def __reduce__(self) -> tuple:  # picklable: raised in worker processes, re-raised in the parent
        return (type(self), (self.key, self.value, self.message))


class DataError(ValueError):
    """A data file or row is unusable; `str()` names the file (and line or row) and what is wrong."""


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
