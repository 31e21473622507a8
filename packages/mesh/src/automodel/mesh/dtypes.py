"""One parser for dtype names in configs, shared by every package (YAML spells dtypes as strings)."""

from __future__ import annotations

import torch

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(value: torch.dtype | str | None, *, key: str) -> torch.dtype | None:
    """A torch dtype, or its name (``bfloat16``, ``bf16``, ``torch.bfloat16``; any case) -> torch.dtype.

    None stays None. Anything else raises ValueError naming `key` and the accepted names.
    """
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
    raise ValueError(f"{key} must be a torch dtype or one of {', '.join(DTYPE_NAMES)}, got {value!r}")
