"""The embedded default corpus: the Python standard library's own source files.

Real text that is on every machine with Python, so examples and tests need no download. The
file list is sorted, so one machine always yields the same corpus; every 20th document is held
out as the validation split.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

_HOLDOUT_EVERY = 20


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    files += sorted(p for p in root.glob("*/*.py") if p.is_file() and "test" not in p.parts[-2])
    return files


def embedded_documents(*, split: str = "train", max_bytes: int = 2_000_000) -> list[str]:
    """Source files of the stdlib for `split` ("train" or "validation"), up to `max_bytes` in total."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    docs: list[str] = []
    total = 0
    for i, path in enumerate(_stdlib_files()):
        held_out = i % _HOLDOUT_EVERY == _HOLDOUT_EVERY - 1
        if held_out != (split == "validation"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        text = text[: max_bytes - total]
        docs.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not docs:
        raise RuntimeError(
            f"no Python standard library sources found under {sysconfig.get_paths()['stdlib']}"
        )
    return docs
