"""Where a run that asked for more steps than its data gives stops, said in one line.

The run's length is ``min(max_steps, steps_per_epoch * num_epochs)``: a run whose data ends first
(``max_steps: 500`` on 26 steps of data) stopped at step 26 without a word about why.
"""

from __future__ import annotations

import math
from typing import ClassVar, Protocol


class StepsSection(Protocol):
    """A training loop's step settings (automodel-recipes' ``step_scheduler``)."""

    SECTION: ClassVar[str]

    @property
    def max_steps(self) -> int | None: ...
    @property
    def num_epochs(self) -> int: ...


def data_end_line(*, step: int, steps_per_epoch: int, section: StepsSection) -> str | None:
    """The line for a run that ended at `step` because its data did, before ``max_steps``;
    None when it ran to ``max_steps``, has no ``max_steps``, or stopped early (pre-empted)."""
    max_steps, epochs = section.max_steps, section.num_epochs
    if max_steps is None or step >= max_steps or step != steps_per_epoch * epochs:
        return None
    need = math.ceil(max_steps / steps_per_epoch)
    s = section.SECTION
    return (
        f"{s}: the data ended at step {step} of {s}.max_steps={max_steps}: {epochs} epoch(s) of "
        f"{steps_per_epoch} steps ({s}.num_epochs={epochs}); set {s}.num_epochs={need} to reach max_steps"
    )
