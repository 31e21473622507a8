"""`datasets` draws a progress bar for each split it generates; a row count before launch draws
none, so a refusal stays one line (the ranks' own reads keep theirs)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """`datasets`' progress bars off inside the block (restored after); nothing without `datasets`."""
    try:
        import datasets  # lazy: optional dependency
    except ImportError:
        yield
        return
    were_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not were_disabled:
            datasets.enable_progress_bars()
