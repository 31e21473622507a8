"""The rank harness itself: results in rank order, failures named by rank, hangs bounded by the time-out."""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from automodel.testing.ranks import RankFailure, RankTimeout, run_on_ranks


def _sum_of_ranks() -> tuple[int, int]:
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    return dist.get_rank(), int(t)


def _rank_two_raises() -> None:
    if dist.get_rank() == 2:
        raise KeyError("boom on purpose")
    dist.barrier()


def _rank_one_hangs(seconds: float) -> None:
    if dist.get_rank() == 1:
        time.sleep(seconds)


def _rank_one_aborts() -> None:
    if dist.get_rank() == 1:
        os.abort()  # as glibc does when it finds the heap corrupted
    dist.barrier()


def _collect_garbage() -> int:
    return gc.collect()


def _returns_tensor() -> torch.Tensor:
    return torch.full((3,), float(dist.get_rank()))


def test_results_come_back_in_rank_order() -> None:
    assert run_on_ranks(_sum_of_ranks, world_size=4) == [(0, 6), (1, 6), (2, 6), (3, 6)]


def test_tensors_survive_the_trip() -> None:
    out = run_on_ranks(_returns_tensor, world_size=2)
    assert torch.equal(out[1], torch.ones(3))


def test_a_raising_rank_is_reported_with_its_rank_and_traceback() -> None:
    with pytest.raises(RankFailure) as err:
        run_on_ranks(_rank_two_raises, world_size=4, timeout_s=120)
    assert err.value.rank == 2
    assert "KeyError: 'boom on purpose'" in err.value.remote_traceback
    assert "rank 2 failed" in str(err.value)


def test_a_hanging_rank_fails_within_the_time_out() -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[(0, )?1\] of 2 did not finish within 3 s") as err:
        run_on_ranks(_rank_one_hangs, world_size=2, args=(600.0,), timeout_s=3)
    assert time.monotonic() - start < 3 + 10
    # The hung rank's own stack names where it hangs, so a CI log is enough to diagnose it.
    stacks = str(err.value).split("--- rank 1 stacks at the time-out ---", 1)[1]
    assert "in _rank_one_hangs" in stacks


def test_a_rank_killed_by_a_signal_is_reported_with_the_signal_and_its_stack() -> None:
    """A native crash sends nothing back; the failure still names the signal and where Python was."""
    with pytest.raises(RankFailure) as err:
        run_on_ranks(_rank_one_aborts, world_size=2, timeout_s=60)
    assert err.value.rank == 1
    message = str(err.value)
    assert "rank 1 died without reporting (exit code -6, SIGABRT)" in message
    stacks = message.split("--- rank 1 stacks at its fatal signal ---", 1)[1]
    assert "Fatal Python error: Aborted" in stacks and "in _rank_one_aborts" in stacks


def test_bad_world_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_on_ranks(_sum_of_ranks, world_size=0)


class _Cycle:
    """Garbage only the cyclic collector frees."""

    self: _Cycle
    group: object


def test_ranks_survive_a_gloo_group_left_in_garbage_by_the_parent() -> None:
    """A gloo group the parent dropped in a reference cycle must not be finalized in a rank.

    Its destructor joins gloo's worker threads, which a forked child does not have: collecting
    it there hung forever (seen on CI as both ranks stuck "Garbage-collecting").
    """
    was_enabled = gc.isenabled()
    gc.disable()  # keep the cycle alive until the ranks are forked
    try:
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        group = dist.new_group([0])
        dist.all_reduce(torch.ones(2), group=group)
        cycle = _Cycle()
        cycle.self, cycle.group = cycle, group
        dist.destroy_process_group()
        del cycle, group, store
        assert len(run_on_ranks(_collect_garbage, world_size=2, timeout_s=60)) == 2
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()  # here, in the parent, where gloo's threads exist


_AFTER_FAKE_MODE = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from automodel.testing.ranks import run_on_ranks


def backward_on_rank():
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()
    return x.grad.tolist()


if __name__ == "__main__":
    with FakeTensorMode():  # what tracing a model or `recipes validate` does in the test process
        torch.zeros(2) + 1
    x = torch.ones(2, requires_grad=True)
    (x * 3).sum().backward()  # a reference computed in the parent, as parity tests do
    print(run_on_ranks(backward_on_rank, world_size=2, timeout_s=60))
"""


def test_ranks_run_backward_after_the_parent_used_fake_tensor_mode(tmp_path) -> None:
    """Forked ranks can run autograd even when the parent entered fake-tensor mode before its first
    backward (which would otherwise start device threads that make forked autograd fail)."""
    import subprocess
    import sys

    script = tmp_path / "after_fake_mode.py"
    script.write_text(_AFTER_FAKE_MODE)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]"
