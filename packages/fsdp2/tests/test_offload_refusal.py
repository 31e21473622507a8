"""Offload is refused only where torch refuses it, with torch's reason: pinned host memory needs CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from automodel.fsdp2.fsdp import check_offload_policy


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA is")
def test_pinned_offload_without_cuda_is_refused_naming_pin_memory() -> None:
    with pytest.raises(ValueError, match=r"pin_memory=True\) needs CUDA.*pin_memory=False"):
        check_offload_policy(CPUOffloadPolicy(pin_memory=True))


def test_unpinned_offload_and_none_pass() -> None:
    check_offload_policy(CPUOffloadPolicy(pin_memory=False))
    check_offload_policy(None)
