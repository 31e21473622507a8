"""Every private torch API the package reaches (automodel/pipeline/torch_internals.py) is where the
installed torch keeps it, and reads what the package expects: this test fails first, naming the
API, when a torch release moves one (as 2.15 moved the stage's forward cache)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import automodel.pipeline
from automodel.pipeline import torch_internals as ti
from automodel.testing.private_torch import private_torch_uses
from automodel.testing.ranks import run_on_ranks

SRC = Path(automodel.pipeline.__file__).parent


def test_the_installed_torch_release_is_a_checked_one() -> None:
    """A new torch release is added to CHECKED_TORCH only after `nox -s torch_range` passed on it."""
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release in ti.CHECKED_TORCH, (
        f"torch {torch.__version__} is not among the releases automodel.pipeline was checked on "
        f"({ti.CHECKED_TORCH}); run `nox -s torch_range` on it and add it to torch_internals.CHECKED_TORCH"
    )


#: undocumented state of torch's PipelineStage / schedules that torch_internals reads for the package
#: (`_compute_outputs` is not listed: step_guard and ddp_stage override it, as torch_internals records)
STAGE_STATE = (
    "fwd_cache", "_forward_chunk_states", "bwd_cache", "args_recv_info", "grad_recv_info", "dw_runner",
    "backward_state", "pipeline_order", "_load_csv", "_schema",
)  # fmt: skip


def test_no_other_module_uses_a_private_torch_name() -> None:
    """torch_internals is the one home: no other module imports a private torch module or name, nor
    reads the stage's undocumented state."""
    assert private_torch_uses(SRC, attributes=STAGE_STATE) == {}


def test_schedule_internals_are_where_checked() -> None:
    action = ti.parse_schedule_action("1F0")
    assert (action.stage_index, action.microbatch_index) == (1, 0)
    assert isinstance(ti.schedule_step_takes_return_outputs(), bool)
    assert ti.op_arguments(torch.ops.aten.add.Tensor)[0].name == "self"


def _stage_internals_on_two_ranks() -> dict:
    """Two stages on two ranks, two micro-batches: what the accessors read inside backward."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    part = nn.Linear(4, 4)
    seen: dict = {"inputs": [], "received": [], "records_left": None}

    class Probe(PipelineStage):
        def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs) -> None:
            seen["inputs"].append([tuple(t.shape) for t in ti.forward_inputs(self, bwd_chunk_id) or []])
            if not self.is_first:
                seen["received"].append(ti.received_arg_count(self, bwd_chunk_id))
            super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    stage = Probe(part, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    for name in ("bwd_cache", "args_recv_info", "grad_recv_info", "dw_runner", "backward_state"):
        assert isinstance(stage.__dict__.get(name), dict), f"PipelineStage.{name} moved"
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: ((out - y) ** 2).sum())
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)
    seen["records_left"] = len(ti._forward_records(stage))
    ti.consume_received_grads(stage, 0)  # nothing left to take after a real backward: a no-op
    ti.drop_split_backward(stage, 0)
    ti.set_input_grads(stage, 0, (None,))
    return seen


def test_weight_pass_actions_are_read_off_a_schedule() -> None:
    class Order:  # a schedule's public pipeline_order: rank -> actions (None: idle)
        def __init__(self, *cells: str) -> None:
            self.pipeline_order = {0: [None, *(ti.parse_schedule_action(c) for c in cells)]}

    assert ti.schedule_splits_backward(Order("0F0", "0I0", "0W0"))
    assert not ti.schedule_splits_backward(Order("0F0", "0B0"))
    assert not ti.schedule_splits_backward(object())  # no pipeline_order (GPipe, 1F1B)


def test_stage_internals_are_where_checked() -> None:
    first, last = run_on_ranks(_stage_internals_on_two_ranks, world_size=2)
    # each micro-batch's forward record holds the stage input (2 rows of 4): the step guard's zeros
    assert first["inputs"] == [[(2, 4)], [(2, 4)]]
    assert last["inputs"] == [[(2, 4)], [(2, 4)]]
    assert last["received"] == [1, 1]
    assert first["records_left"] == last["records_left"] == 0


def test_a_moved_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    class Bare:
        pass

    with pytest.raises(
        ti.TorchInternalsMoved, match=r"moved PipelineStage's forward cache .*torch_internals\.py"
    ):
        ti.forward_inputs(Bare(), 0)
    monkeypatch.delattr(ti.schedules, "_Action")
    with pytest.raises(ti.TorchInternalsMoved, match="_Action"):
        ti.parse_schedule_action("0F0")


def test_every_module_imports() -> None:
    for info in pkgutil.iter_modules([str(SRC)]):
        importlib.import_module(f"automodel.pipeline.{info.name}")
