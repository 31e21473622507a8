"""What the installed torch cannot do on the CPU test backend, for the suite's skips (one home).

torch 2.11 sets up a schedule with several stages per rank by sending a tensor between
neighbouring stages over the process group; a V-shape schedule (zbv, dualpipev) holds stages i and
i+1 on one rank, so that is a send to itself, which gloo rejects. automodel.pipeline refuses such a
layout before building it (`layout.check_adjacent_stages_on_one_rank`, tested on its own); the
parity tests of those schedules then have nothing to run on that torch.
"""

from __future__ import annotations

from typing import Any

import torch

#: `pp_schedule` spellings (lower case) whose layout puts adjacent stages on one rank
V_SHAPE_SCHEDULE_NAMES = frozenset({"zbv", "v_schedule", "zbvzerobubble", "dualpipev", "dualpipe_v"})


def v_schedules_run_on_gloo(torch_version: str = torch.__version__) -> bool:
    """Whether a V-shape schedule can be set up over gloo on this torch (not on 2.11)."""
    return not torch_version.startswith("2.11.")


def names_a_v_schedule(value: Any) -> bool:
    """Whether a test parameter names a V-shape schedule (a schedule name, or a case id holding one)."""
    if not isinstance(value, str):
        return False
    text = value.lower()
    return text in V_SHAPE_SCHEDULE_NAMES or "zbv" in text or "dualpipe" in text
