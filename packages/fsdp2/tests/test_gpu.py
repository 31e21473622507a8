"""CUDA-only paths (collected by `nox -s gpu_tests`): compile with inductor, pinned offload, async TP config."""

from __future__ import annotations

import pytest
import torch
from fsdp2_testlib import tiny_model

from automodel.fsdp2 import apply_compile


def test_apply_compile_is_in_place_and_keeps_state_dict_keys() -> None:
    model = tiny_model()
    keys = list(model.state_dict())
    assert apply_compile(model, backend="eager") == 2
    assert list(model.state_dict()) == keys
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)


@pytest.mark.gpu
def test_compiled_layers_match_eager_on_cuda() -> None:
    torch.manual_seed(0)
    eager = tiny_model().cuda()  # pyright: ignore[reportCallIssue]  # @wraps'd HF method (typeshed)
    compiled = tiny_model().cuda()  # pyright: ignore[reportCallIssue]  # @wraps'd HF method (typeshed)
    apply_compile(compiled)
    ids = torch.randint(0, 256, (2, 16), device="cuda")
    torch.testing.assert_close(
        compiled(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=1e-4, atol=1e-4
    )


@pytest.mark.gpu
def test_pinned_cpu_offload_default_on_cuda() -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from automodel.fsdp2 import FSDP2Config

    cfg = FSDP2Config(offload_policy=True)
    assert isinstance(cfg.offload_policy, CPUOffloadPolicy) and cfg.offload_policy.pin_memory is True
