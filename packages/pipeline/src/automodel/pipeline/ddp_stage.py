"""Stages wrapped by `DistributedDataParallel` (a `parallelize_fn` of the user's): DDP must see
exactly the backward passes torch's stage announces to it.

torch's stage runs DDP's forward under ``no_sync`` and arms DDP's reducer itself before the last
micro-batch's backward, so gradients are all-reduced once per step. Its stage-shape inference
(torch >= 2.13, ``_compute_outputs`` on the first step) runs the stage module with gradients on but
outside ``no_sync``: DDP then arms its reducer for a backward that never comes, and the first real
micro-batch's backward all-reduces early (GPipe: "rebuilt parameter indices size is not same as
original model parameters size" on the next step). Rule: a DDP stage runs shape inference under
``no_sync`` like any other forward (on torch 2.11, shape inference goes through the stage's
``forward_maybe_with_nosync``, which torch already runs under ``no_sync``; see `torch_internals`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from automodel.pipeline import torch_internals
from automodel.pipeline.step_guard import GuardedStage


class PipelineStageWithDDP(GuardedStage):
    """`GuardedStage` whose shape-inference forward keeps a DDP stage module's reducer unarmed."""

    def _compute_outputs(self, *args: Any, **kwargs: Any) -> Any:
        module = kwargs.get("module", self.submod)
        if isinstance(module, DistributedDataParallel):
            with module.no_sync():
                return super()._compute_outputs(*args, **kwargs)
        return super()._compute_outputs(*args, **kwargs)


def check_ddp_schedule(schedule: Any, *, parts: list[nn.Module], stage_ids: list[int], name: str) -> None:
    """Refuse DDP-wrapped stages under a schedule that splits backward into input and weight passes
    (its ``W`` actions: zero-bubble, DualPipeV, a CSV naming them).

    Rule: DDP all-reduces from the hooks that autograd runs when it accumulates a parameter's
    gradient in a full backward; torch's weight pass computes the parameter gradients itself and
    sets them, so DDP would never sync them over dp (the ranks' weights drift apart silently).
    """
    wrapped = [s for s, part in zip(stage_ids, parts) if isinstance(part, DistributedDataParallel)]
    if wrapped and torch_internals.schedule_splits_backward(schedule):
        raise ValueError(
            f"parallelize_fn wrapped pipeline stage {wrapped[0]} in DistributedDataParallel, but "
            f"pp_schedule {name} splits each backward into an input and a weight pass, and DDP syncs "
            "gradients only in a full backward (its weights' gradients would never be all-reduced over "
            "dp): with DDP use a schedule with full backward passes (gpipe, 1f1b, interleaved1f1b, "
            "looped_bfs), or do not wrap the stages in DDP"
        )


def release_ddp_process_groups(module: nn.Module) -> None:
    """At teardown (`PipelineModel.release_process_groups`): drop what keeps a DDP stage's process
    group alive (the group, and the C++ reducer and logger holding it); the module cannot train after."""
    if isinstance(module, DistributedDataParallel):
        for attr in ("reducer", "logger"):
            if attr in vars(module):
                delattr(module, attr)
        module.process_group = None
