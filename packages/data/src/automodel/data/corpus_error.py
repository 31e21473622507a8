"""The error for a token file that cannot be read as what it claims to be (names the file)."""

from __future__ import annotations


class CorpusError(ValueError):
    """A token corpus file is missing, truncated, inconsistent or unusable; the message names it."""

    def __init__(self, path: object, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = str(path)
        self.why = why

    def __reduce__(self) -> tuple:
        return (type(self), (self.path, self.why))
