"""The training loop's own rules: time-out classification, the pipeline loss scale, CP padding."""

from __future__ import annotations

import torch
import torch.distributed as dist

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.recipes.parallelisms.cp import context_parallel_inputs
from automodel.recipes.trainer import StepScaledLoss, is_collective_timeout
from automodel.testing.ranks import run_on_ranks

PAD = 7


def test_backend_errors_are_time_outs_whatever_the_wait():
    assert is_collective_timeout(dist.DistBackendError("watchdog"), waited_s=0.1, timeout_s=60)


def test_plain_runtime_error_is_a_time_out_only_after_the_time_out():
    # gloo's time-out is a bare RuntimeError: only the time waited tells it from any other failure
    error = RuntimeError("Timed out waiting 6000ms for recv operation to complete")
    assert not is_collective_timeout(error, waited_s=1.0, timeout_s=6.0)
    assert is_collective_timeout(error, waited_s=6.5, timeout_s=6.0)
    assert not is_collective_timeout(ValueError("bad shape"), waited_s=100.0, timeout_s=6.0)


def test_pipeline_loss_is_divided_by_the_step_divisor():
    loss = StepScaledLoss(lambda logits, labels: (logits - labels).abs().sum())
    logits, labels = torch.full((2, 3), 4.0), torch.zeros(2, 3)
    assert loss(logits, labels).item() == 24.0
    loss.set_divisor(torch.tensor(6.0))
    assert loss(logits, labels).item() == 4.0
    loss.set_divisor(1.0)
    assert loss(logits, labels).item() == 24.0


def _cp_pads_with_tokenizer_pad_id() -> list[int]:
    mesh = MeshContext.build(ParallelismSizes(cp_size=dist.get_world_size()))
    seq = 6  # padded to 8: 2 * cp = 4 chunks of 2, the last one all padding
    fields = {
        "input_ids": torch.arange(1, seq + 1).unsqueeze(0),
        "labels": torch.arange(1, seq + 1).unsqueeze(0),
        "position_ids": torch.arange(seq).unsqueeze(0),
    }
    _, local, _ = context_parallel_inputs(
        fields, cp_mesh=mesh.get_mesh("cp"), backend="ring", pad_token_id=PAD, packed=False
    )
    assert (local["labels"][local["input_ids"] == PAD] == -100).all()
    return local["input_ids"].flatten().tolist()


def test_context_parallel_padding_uses_the_tokenizers_pad_id():
    rank0, rank1 = run_on_ranks(_cp_pads_with_tokenizer_pad_id, world_size=2, timeout_s=120)
    # load balancing: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert rank0 == [1, 2, PAD, PAD]
    assert rank1 == [3, 4, 5, 6]
