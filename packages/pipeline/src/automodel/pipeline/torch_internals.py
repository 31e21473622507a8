"""Every private torch API this package uses, in one place, each with the torch versions checked.

torch's pipelining exposes no public hook for what the step guard does (recording a stage's error
and playing the rest of the schedule on placeholders), and no public trace or pytree API for
reading a model's dataflow; so these few names are reached here and nowhere else. Each accessor
fails with `TorchInternalsMoved` (naming the torch version and this module) instead of an
`AttributeError` deep inside a schedule, and `tests/test_torch_internals.py` checks every one of
them against the installed torch: a torch that moves one fails that test first.

Checked on torch 2.11, 2.13, 2.14 and 2.15 (`nox -s torch_range`):

- `PipelineStage.fwd_cache` (<= 2.14: chunk -> (outputs, flat inputs)) became
  `PipelineStage._forward_chunk_states` (2.15: chunk -> state with `.input_values`).
- `PipelineStage.bwd_cache`, `args_recv_info`, `grad_recv_info`, `dw_runner`, `backward_state`:
  all versions. 2.15's receive descriptors own their buffer until `take_buffer()`, and refuse the
  next step's receive into a buffer not taken.
- `PipelineStage._compute_outputs`: shape inference runs the stage through it on >= 2.13 (absent
  on 2.11, where `forward_maybe_with_nosync` does it).
- `schedules._PipelineScheduleRuntime` with `_load_csv`, and `schedules._Action.from_str`: all
  versions (no public class plays or parses a CSV schedule).
- `schedules._ComputationType.BACKWARD_WEIGHT` (a schedule's weight-pass actions, read off its
  public `pipeline_order`): checked on the installed torch 2.13 only; `ddp_stage` refuses DDP stages
  under such schedules. `ddp_stage` also overrides `PipelineStage._compute_outputs` (above) to run
  a DDP stage's shape inference under `no_sync`.
- `torch.utils._pytree`, `torch.utils._python_dispatch.TorchDispatchMode`,
  `torch._subclasses.fake_tensor.FakeTensorMode`, `OpOverload._schema`: all versions (no public
  module holds them on 2.11-2.15).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.schedules import PipelineScheduleMulti
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = [
    "CHECKED_TORCH",
    "FakeTensorMode",
    "TorchDispatchMode",
    "TorchInternalsMoved",
    "drop_split_backward",
    "forward_inputs",
    "consume_received_grads",
    "csv_schedule",
    "op_arguments",
    "parse_schedule_action",
    "pop_forward_record",
    "received_arg_count",
    "schedule_splits_backward",
    "schedule_step_takes_return_outputs",
    "set_input_grads",
    "stage_computes_outputs_privately",
    "tree_leaves",
    "tree_map_only",
]

#: torch releases (major.minor) on which every accessor below was run by the package's tests
CHECKED_TORCH = ("2.11", "2.13", "2.14", "2.15")


class TorchInternalsMoved(RuntimeError):
    """A private torch API this package relies on is not where any checked torch kept it."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"torch {torch.__version__} moved {what}, a private torch API that automodel.pipeline "
            f"relies on (checked on torch {', '.join(CHECKED_TORCH)}; see "
            "automodel/pipeline/torch_internals.py). Install a checked torch or update that module"
        )


def _forward_records(stage: PipelineStage) -> dict[int, Any]:
    """The stage's per-micro-batch forward records (what its backward reads)."""
    for name in ("_forward_chunk_states", "fwd_cache"):  # 2.15 and later; up to 2.14
        records = stage.__dict__.get(name)
        if isinstance(records, dict):
            return records
    raise TorchInternalsMoved("PipelineStage's forward cache (fwd_cache / _forward_chunk_states)")


def forward_inputs(stage: PipelineStage, chunk: int) -> list[Any] | None:
    """The flat inputs (args, then kwargs) the stage's forward of `chunk` saw, None if not recorded."""
    record = _forward_records(stage).get(chunk)
    if record is None:
        return None
    if isinstance(record, tuple):  # up to 2.14: (outputs, flat inputs)
        return list(record[1])
    inputs = getattr(record, "input_values", None)
    if inputs is None:
        raise TorchInternalsMoved("the input values of PipelineStage's forward chunk state")
    return list(inputs)


def pop_forward_record(stage: PipelineStage, chunk: int) -> None:
    """Drop the forward record of `chunk` (outputs and graph), as a backward would."""
    _forward_records(stage).pop(chunk, None)


def set_input_grads(stage: PipelineStage, chunk: int, grads: tuple[torch.Tensor | None, ...]) -> None:
    """What the schedule sends to the previous stage after the backward of `chunk`."""
    cache = stage.__dict__.get("bwd_cache")
    if not isinstance(cache, dict):
        raise TorchInternalsMoved("PipelineStage.bwd_cache")
    cache[chunk] = grads


def consume_received_grads(stage: PipelineStage, chunk: int) -> None:
    """Release the output-gradient buffers received for `chunk` that no backward took. torch >= 2.15
    keeps each receive buffer owned until the stage takes it and refuses the next step's receive
    into a buffer still owned; earlier torch preallocates them once (nothing to release)."""
    infos = stage.__dict__.get("grad_recv_info")
    if not isinstance(infos, dict):
        raise TorchInternalsMoved("PipelineStage.grad_recv_info")
    for info in infos.get(chunk, ()):
        take = getattr(info, "take_buffer", None)  # >= 2.15
        if take is not None and getattr(info, "buffer", None) is not None:
            take()


def received_arg_count(stage: PipelineStage, chunk: int) -> int:
    """How many positional inputs the stage receives from the previous stage for `chunk`."""
    infos = stage.__dict__.get("args_recv_info")
    if not isinstance(infos, dict):
        raise TorchInternalsMoved("PipelineStage.args_recv_info")
    return len(infos[chunk])


def drop_split_backward(stage: PipelineStage, chunk: int) -> None:
    """Forget what a split (input-then-weight) backward left for `chunk`."""
    for name in ("dw_runner", "backward_state"):
        state = stage.__dict__.get(name)
        if not isinstance(state, dict):
            raise TorchInternalsMoved(f"PipelineStage.{name}")
        state.pop(chunk, None)


def stage_computes_outputs_privately() -> bool:
    """Whether torch's shape inference runs the stage through `_compute_outputs` (>= 2.13)."""
    return hasattr(PipelineStage, "_compute_outputs")


def csv_schedule(
    stages: list[PipelineStage], *, n_microbatches: int, loss_fn: Any, scale_grads: bool, path: str
) -> PipelineScheduleMulti:
    """torch's schedule runtime playing a compute-only CSV schedule (one row per pp rank)."""
    runtime = getattr(schedules, "_PipelineScheduleRuntime", None)
    load = getattr(runtime, "_load_csv", None)
    if runtime is None or load is None:
        raise TorchInternalsMoved("torch.distributed.pipelining.schedules._PipelineScheduleRuntime._load_csv")
    schedule = runtime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    schedule._load_csv(path)
    return schedule


def schedule_step_takes_return_outputs() -> bool:
    """Whether the schedules' `step` takes `return_outputs` (every checked torch; kept as a probe since torch added it late)."""
    return "return_outputs" in inspect.signature(PipelineScheduleMulti.step).parameters


def schedule_splits_backward(schedule: Any) -> bool:
    """Whether the schedule's actions include weight passes (``W``: each backward split into an
    input and a weight pass, as zero-bubble schedules and DualPipeV do)."""
    kinds = getattr(schedules, "_ComputationType", None)
    weight = getattr(kinds, "BACKWARD_WEIGHT", None)
    if weight is None:
        raise TorchInternalsMoved("torch.distributed.pipelining.schedules._ComputationType.BACKWARD_WEIGHT")
    order = getattr(schedule, "pipeline_order", None) or {}
    return any(a is not None and a.computation_type == weight for actions in order.values() for a in actions)


def parse_schedule_action(cell: str) -> Any:
    """One CSV cell (`0F1`, `2B0`, ...) as torch's schedule action; ValueError when malformed."""
    action = getattr(schedules, "_Action", None)
    if action is None:
        raise TorchInternalsMoved("torch.distributed.pipelining.schedules._Action")
    return action.from_str(cell)


def op_arguments(func: Any) -> list[Any]:
    """The schema arguments of an aten `OpOverload` (names, alias info)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        raise TorchInternalsMoved("OpOverload._schema")
    return list(schema.arguments)
