"""Third-party log lines that tell a `recipes` user nothing, dropped by their exact text.

torchao (the ``fp8`` extra) registers its Enum types as pytree constants when imported, and
transformers imports torchao whenever it is installed; torch >= 2.12 logs a deprecation warning
for each of them on every run (two ``W... torch/utils/_pytree.py ... is an Enum subclass`` lines),
which would break the one-line error contract of the CLI. torchao 0.18's sources also hold an
invalid escape sequence, which Python reports while compiling them when no bytecode was compiled at
install (``uv sync`` without ``--compile-bytecode``, ``PYTHONDONTWRITEBYTECODE``). Nothing else is
filtered.
"""

from __future__ import annotations

import logging
import warnings

_ENUM_NOTICE = "is an Enum subclass and is now natively supported by torch.compile"


class _DropEnumConstantNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _ENUM_NOTICE not in record.getMessage()


def quiet_known_notices() -> None:
    """Install the filter on torch's pytree logger (once per process) and the compile-time warning's."""
    warnings.filterwarnings(
        "ignore", message=r"invalid escape sequence", category=DeprecationWarning, module=r".*torchao"
    )
    from automodel.recipes.torch_internals import PYTREE_LOGGER  # lazy: start-up, torch_internals ~0.6 s

    logger = logging.getLogger(PYTREE_LOGGER)
    if not any(isinstance(f, _DropEnumConstantNotice) for f in logger.filters):
        logger.addFilter(_DropEnumConstantNotice())
