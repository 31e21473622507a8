"""Stage errors inside a training `step`, raised on every pp rank instead of leaving peers waiting.

torch's schedules interleave sends and receives between the pp ranks: when a stage forward, the
loss or a backward raises on one rank, its peers block in a receive that never completes (until
the process-group timeout, 10 minutes by default), and a caller that catches the exception (a
notebook, a retry loop) never learns why. Here the failing rank does not leave the schedule: the
stage records its first error and plays the rest of the step with placeholders of the shapes it
sent before (zeros, whose gradients are zeros), so every send and receive still pairs up. After
the schedule, one small all-reduce over the pp group tells every rank whether some stage failed;
if so each rank drops the step's gradients and raises the same `PipelineStageError`.

The shapes come from the stage's last good forward; on the first step, before any, `PipelineModel`
runs one forward-only micro-batch first (`forward_only`), which fails on every rank alike.

Scope: the pp group. Collectives inside a stage (FSDP's reduce-scatter over dp, TP) run or fail
as they would without pipelining.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from automodel.pipeline import torch_internals
from automodel.pipeline.forward_only import PipelineStageError

#: (shape, dtype, requires_grad) of one output position, None where the stage returns None
TensorSpec = tuple[tuple[int, ...], torch.dtype, bool] | None


@dataclass
class OutputSpec:
    """What a stage's forward returned: one tensor or a tuple, and each position's spec."""

    is_tuple: bool
    specs: list[TensorSpec]

    @classmethod
    def of(cls, output: Any) -> OutputSpec | None:
        """The spec of `output`, or None when it is not a tensor or a tuple of tensors/None."""
        items = output if isinstance(output, tuple) else (output,)
        specs: list[TensorSpec] = []
        for t in items:
            if t is None:
                specs.append(None)
            elif isinstance(t, torch.Tensor):
                local = t.to_local() if isinstance(t, DTensor) else t
                # under no_grad (the first-step check) a float output stands for one that needs grad
                grad = t.requires_grad or (not torch.is_grad_enabled() and t.is_floating_point())
                specs.append((tuple(local.shape), local.dtype, grad))
            else:
                return None
        return cls(is_tuple=isinstance(output, tuple), specs=specs)

    def placeholder(self, inputs: Sequence[Any], device: torch.device) -> Any:
        """Zeros of these shapes. Float outputs hang on the float inputs through `_ZeroLink` (so the
        stage's backward sends dense zero gradients to the previous stage) or are leaves."""
        linked = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        anchor = _ZeroLink.apply(*linked) if linked else None
        out: list[torch.Tensor | None] = []
        for spec in self.specs:
            if spec is None:
                out.append(None)
                continue
            shape, dtype, grad = spec
            t = torch.zeros(shape, dtype=dtype, device=device)
            if grad and dtype.is_floating_point:
                t = t + anchor.to(dtype) if isinstance(anchor, torch.Tensor) else t.requires_grad_()
            out.append(t)
        return tuple(out) if self.is_tuple else out[0]


#: torch < 2.13 needs a gradient for every received input that requires one: 2.11 refuses to send
#: None back ("has gradients None"), 2.12's split backward differentiates without allow_unused. A
#: stage whose layers leave a received value unread (Gemma 3n's carried keys/values on a stage
#: after the last layer that reads them) then fails; newer torch sends such gradients as zeros.
_INPUTS_NEED_A_GRADIENT = tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13)


def _link_every_input(output: Any, inputs: Sequence[Any]) -> Any:
    """`output` hung on every grad-requiring input (`_LinkInputs`), so each input gets a (zero or
    real) gradient: the stage's numbers and output layout are unchanged."""
    linked = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    items = list(output) if isinstance(output, tuple) else [output]
    target = next(
        (
            i
            for i, t in enumerate(items)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
        ),
        None,
    )
    if not linked or target is None:
        return output
    items[target] = _LinkInputs.apply(items[target], *linked)
    return tuple(items) if isinstance(output, tuple) else items[0]


class _LinkInputs(torch.autograd.Function):
    """`output` itself (a view: same shape and strides, which the schedule checks against the
    shape inference) whose backward also gives each linked input a dense zero gradient."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.specs = [(x.shape, x.dtype, x.device) for x in inputs]
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        zeros = tuple(torch.zeros(shape, dtype=dtype, device=dev) for shape, dtype, dev in ctx.specs)
        return (grad, *zeros)


class _ZeroLink(torch.autograd.Function):
    """A zero scalar whose backward gives each input a dense, contiguous zero gradient (the
    receiving stage allocates its buffer with the strides it saw; an expanded zero would not do)."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.specs = [(x.shape, x.dtype, x.device) for x in inputs]
        return torch.zeros((), dtype=torch.float32, device=inputs[0].device)

    @staticmethod
    def backward(ctx: Any, *grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(shape, dtype=dtype, device=dev) for shape, dtype, dev in ctx.specs)


@dataclass
class StepErrors:
    """The first error of this rank's stages in the current `step` (shared by its stages and loss)."""

    stage: int | None = None
    phase: str = ""
    message: str = ""
    cause: BaseException | None = None
    skipped_backward: set[tuple[int, int]] = field(default_factory=set)

    @property
    def failed(self) -> bool:
        return self.stage is not None

    def record(self, *, stage: int, phase: str, error: BaseException) -> None:
        if self.stage is None:
            root = error
            while root.__cause__ is not None:  # torch wraps a backward error in its own RuntimeError
                root = root.__cause__
            self.stage, self.phase, self.cause = stage, phase, error
            self.message = f"{type(root).__name__}: {root}"

    def reset(self) -> None:
        self.stage, self.phase, self.message, self.cause = None, "", "", None
        self.skipped_backward.clear()


class GuardedStage(PipelineStage):
    """A `PipelineStage` whose forward and backward errors are recorded in `errors`, not raised:
    the rest of the step runs on placeholders so the peers' receives complete."""

    def __init__(self, *args: Any, errors: StepErrors, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.errors = errors
        #: the outputs of the last good forward (set by the forward-only check on the first step)
        self.output_spec: OutputSpec | None = None

    def _guarded_forward(self, run: Callable[[], Any], inputs: Sequence[Any]) -> Any:
        if not self.errors.failed:
            try:
                output = run()
            except Exception as e:  # noqa: BLE001 - raised on every pp rank after the schedule
                if self.output_spec is None and not self.is_last:
                    raise  # no shapes to stand in with (the first-step check normally rules this out)
                self.errors.record(stage=self.stage_index, phase="forward", error=e)
            else:
                self.output_spec = OutputSpec.of(output) or self.output_spec
                return _link_every_input(output, inputs) if _INPUTS_NEED_A_GRADIENT else output
        if self.output_spec is not None:
            return self.output_spec.placeholder(inputs, self.device)
        if self.is_last:  # only the (guarded) loss reads it
            return torch.zeros((), device=self.device, requires_grad=True)
        raise RuntimeError(
            f"pipeline stage {self.stage_index} has no output shapes to stand in with after an error on "
            "this rank (the first step's forward-only check did not run)"
        )

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        return self._guarded_forward(
            lambda: super(GuardedStage, self).forward_maybe_with_nosync(*args, **kwargs), args
        )

    def _compute_outputs(self, *args: Any, **kwargs: Any) -> Any:
        """torch >= 2.13 runs the first step's shape inference through here (not the method above)."""
        return self._guarded_forward(
            lambda: super(GuardedStage, self)._compute_outputs(*args, **kwargs), args
        )

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        if not self.has_backward:
            return
        inputs = torch_internals.forward_inputs(self, bwd_chunk_id)
        if not self.errors.failed:
            try:
                super().backward_one_chunk(
                    bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
                )
                return
            except Exception as e:  # noqa: BLE001 - raised on every pp rank after the schedule
                self.errors.record(stage=self.stage_index, phase="backward", error=e)
        self._skip_backward(bwd_chunk_id, inputs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        if (self.stage_index, bwd_chunk_id) in self.errors.skipped_backward or self.errors.failed:
            torch_internals.drop_split_backward(self, bwd_chunk_id)
            return
        try:
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        except Exception as e:  # noqa: BLE001 - raised on every pp rank after the schedule
            self.errors.record(stage=self.stage_index, phase="backward", error=e)

    def _skip_backward(self, chunk: int, inputs: list[Any] | None) -> None:
        """Leave what the schedule reads after a backward: zero gradients for the inputs it sends back."""
        torch_internals.pop_forward_record(self, chunk)
        if not self.is_last:  # the gradients the next stage sent for this chunk are taken, unused
            torch_internals.consume_received_grads(self, chunk)
        self.errors.skipped_backward.add((self.stage_index, chunk))
        n_args = 0 if self.is_first else torch_internals.received_arg_count(self, chunk)
        grads = tuple(
            torch.zeros_like(v) if isinstance(v, torch.Tensor) and v.requires_grad else None
            for v in (inputs or [])[:n_args]
        )
        torch_internals.set_input_grads(self, chunk, grads)


def guard_loss(
    loss_fn: Callable[..., torch.Tensor], *, errors: StepErrors, last_stage: int
) -> Callable[..., torch.Tensor]:
    """`loss_fn` for the schedule: an error is recorded (the loss of a failed step is a zero)."""

    def guarded(output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        if not errors.failed:
            try:
                return loss_fn(output, target, **kwargs)
            except Exception as e:  # noqa: BLE001 - raised on every pp rank after the schedule
                errors.record(stage=last_stage, phase="loss_fn", error=e)
        items = output if isinstance(output, tuple) else (output,)
        terms = [t.sum() * 0 for t in items if isinstance(t, torch.Tensor) and t.requires_grad]
        return torch.stack(terms).sum() if terms else torch.zeros((), requires_grad=True)

    return guarded


def raise_if_any_failed(
    errors: StepErrors, *, group: dist.ProcessGroup, device: torch.device, on_failure: Callable[[], None]
) -> None:
    """Collective over the pp group: one MAX all-reduce of a flag; when some rank failed, gather the
    messages, call `on_failure` (drop the step's gradients) and raise the same error everywhere."""
    flag = torch.tensor([1 if errors.failed else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return
    mine = (errors.stage, errors.phase, errors.message) if errors.failed else None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    cause = errors.cause
    errors.reset()
    on_failure()
    rank, (stage, phase, message) = next((r, g) for r, g in enumerate(gathered) if g is not None)
    raise PipelineStageError(
        f"pipeline stage {stage} (pp rank {rank}) failed in its {phase} during step(): {message}. "
        "Every pp rank raises this error; the step's gradients were dropped (set to None) on every pp "
        "rank, so the pipeline can take the next step once the cause is fixed"
    ) from (cause if rank == dist.get_rank(group) else None)
