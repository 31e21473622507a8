"""Which fault cases a run collects: the CPU suite runs the quick ones, `nox -s faults` every one.

`nox -s faults` sets ``AUTOMODEL_FAULTS=all``; a case marked `full_only` (a slow subprocess or
multi-rank run) is skipped without it, with a reason naming the session.
"""

from __future__ import annotations

import os

import pytest

FULL = os.environ.get("AUTOMODEL_FAULTS") == "all"
full_only = pytest.mark.skipif(not FULL, reason="in `nox -s faults` (AUTOMODEL_FAULTS=all)")
