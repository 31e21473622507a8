"""`PipelineConfig`: the `pipeline:` section of a recipe, validated when constructed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import Literal

import torch

from automodel.mesh import parse_dtype
from automodel.pipeline.schedules import ScheduleSpec, resolve_schedule


def _positive_int(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class PipelineConfig:
    """How a model is split into pipeline stages and which schedule runs them.

    `pp_batch_size` is the batch one data-parallel rank feeds to `step()` per optimizer step;
    it is cut into `pp_batch_size // pp_microbatch_size` micro-batches. `layers_per_stage` (or
    an explicit `module_fqns_per_model_part`) sets the number of stages; by default a
    single-stage schedule gets one stage per rank and a multi-stage schedule two.
    """

    pp_schedule: str = "1f1b"
    pp_schedule_csv: str | None = None
    pp_microbatch_size: int = 1
    pp_batch_size: int = 1
    layers_per_stage: int | None = None
    round_virtual_stages_to_pp_multiple: Literal["up", "down"] | None = None
    module_fqns_per_model_part: list[list[str]] | None = None
    scale_grads_in_schedule: bool = False
    dtype: torch.dtype | str | None = None
    pp_seq_len: int | None = None

    def __post_init__(self) -> None:
        self.schedule_spec  # noqa: B018 - resolves (and so validates) pp_schedule
        _positive_int("pp_microbatch_size", self.pp_microbatch_size)
        _positive_int("pp_batch_size", self.pp_batch_size)
        if self.pp_batch_size % self.pp_microbatch_size != 0:
            b, m = self.pp_batch_size, self.pp_microbatch_size
            near = " or ".join(str(x) for x in (b // m * m, b // m * m + m) if x > 0)
            raise ValueError(
                f"pp_batch_size={b} is not divisible by pp_microbatch_size={m} (each step is cut into "
                f"micro-batches of pp_microbatch_size rows): set pp_batch_size to a multiple of it "
                f"(e.g. {near}) or pp_microbatch_size to a divisor of {b}"
            )
        if self.layers_per_stage is not None:
            _positive_int("layers_per_stage", self.layers_per_stage)
        if self.round_virtual_stages_to_pp_multiple not in (None, "up", "down"):
            raise ValueError(
                "round_virtual_stages_to_pp_multiple must be 'up', 'down' or None, "
                f"got {self.round_virtual_stages_to_pp_multiple!r}"
            )
        if self.pp_seq_len is not None:
            _positive_int("pp_seq_len", self.pp_seq_len)
        if not isinstance(self.scale_grads_in_schedule, bool):
            raise ValueError(f"scale_grads_in_schedule must be a bool, got {self.scale_grads_in_schedule!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype, key="dtype"))
        self._check_fqns()
        if self.pp_schedule_csv is not None:  # its file is checked where it is read (`check_schedule_csv`)
            if not isinstance(self.pp_schedule_csv, str | PurePath):
                raise ValueError(f"pp_schedule_csv must be a path, got {self.pp_schedule_csv!r}")
            object.__setattr__(self, "pp_schedule_csv", str(self.pp_schedule_csv))
        if self.module_fqns_per_model_part is not None and self.layers_per_stage is not None:
            raise ValueError(
                "set either module_fqns_per_model_part or layers_per_stage, not both "
                f"(layers_per_stage={self.layers_per_stage})"
            )

    def _check_fqns(self) -> None:
        parts = self.module_fqns_per_model_part
        if parts is None:
            return
        if not isinstance(parts, list | tuple) or not parts:
            raise ValueError(f"module_fqns_per_model_part must be a non-empty list of lists, got {parts!r}")
        for i, part in enumerate(parts):
            if (
                not isinstance(part, list | tuple)
                or not part
                or not all(isinstance(n, str) and n for n in part)
            ):
                raise ValueError(
                    f"module_fqns_per_model_part[{i}] must be a non-empty list of module names, got {part!r}"
                )
        object.__setattr__(self, "module_fqns_per_model_part", [list(p) for p in parts])

    # ---- derived -------------------------------------------------------------------------
    @property
    def schedule_spec(self) -> ScheduleSpec:
        return resolve_schedule(self.pp_schedule)

    @property
    def n_microbatches(self) -> int:
        return self.pp_batch_size // self.pp_microbatch_size
