"""The trace's fast path gives exactly torch's meta results (shape and dtype) or defers to torch.

Each case runs the operator on meta tensors twice: through torch's own meta kernels and through
`fast_meta_result`; where the fast path answers, shape and dtype must be equal. The structure the
pipeline split reads off a real model's traced forward is the same with and without it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.pipeline.meta_fast_path import fast_meta_result

aten = torch.ops.aten


def _m(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16
CASES = [
    (aten.mul.Tensor, (_m(2, 3, 4, dtype=BF16), _m(4, dtype=BF16)), {}),
    (aten.mul.Tensor, (_m(2, 1, 4), _m(3, 1)), {}),  # broadcast both ways
    (aten.mul.Tensor, (_m(2, 4, dtype=BF16), _m(2, 4)), {}),  # bf16 x fp32 -> fp32
    (aten.mul.Tensor, (_m(2, 4, dtype=BF16), 0.5), {}),  # a number keeps the tensor's dtype
    (aten.mul.Tensor, (_m(2, 4, dtype=F16), torch.tensor(2.0, dtype=torch.float64)), {}),  # 0-dim CPU
    (aten.add.Tensor, (_m(5, 1, dtype=F16), _m(1, 6, dtype=F16)), {"alpha": 2}),
    (aten.sub.Tensor, (_m(3), 1), {}),
    (aten.div.Tensor, (_m(2, 2, dtype=BF16), 3), {}),
    (aten.neg.default, (_m(2, 3, dtype=BF16),), {}),
    (aten.rsqrt.default, (_m(2, 3, 1),), {}),
    (aten.silu.default, (_m(7, dtype=F16),), {}),
    (aten.pow.Tensor_Scalar, (_m(2, 8, dtype=BF16), 2), {}),
    (aten.pow.Tensor_Scalar, (_m(2, 8), 0.5), {}),
    (aten.mean.dim, (_m(2, 3, 8), [-1], True), {}),
    (aten.mean.dim, (_m(2, 3, 8), [0, 2]), {}),
    (aten.cat.default, ([_m(2, 3), _m(2, 5)], -1), {}),
    (aten.cat.default, ([_m(4, 3, dtype=BF16), _m(1, 3)],), {}),  # promotes
    # deferred to torch: integer inputs, dtype-changing forms
    (aten.mul.Tensor, (_m(2, dtype=torch.long), _m(2, dtype=torch.long)), {}),
    (aten.div.Tensor, (_m(2, dtype=torch.long), 2), {}),
    (aten.rsqrt.default, (_m(3, dtype=torch.long),), {}),
    (aten.mean.dim, (_m(2, 3), [1]), {"dtype": torch.float64}),
    (aten.pow.Tensor_Scalar, (_m(2, dtype=torch.long), 2), {}),
]


@pytest.mark.parametrize(("op", "args", "kwargs"), CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_fast_result_is_torchs_meta_result(op, args, kwargs) -> None:
    expected = op(*args, **kwargs)
    got = fast_meta_result(op, args, kwargs)
    if got is None:  # deferred: the integer / dtype-changing forms must be among these
        assert any(isinstance(a, torch.Tensor) and not a.is_floating_point() for a in args) or kwargs.get(
            "dtype"
        )
        return
    assert (got.shape, got.dtype, got.device.type) == (expected.shape, expected.dtype, "meta")


def test_floating_cases_are_answered_by_the_fast_path() -> None:
    answered = [c for c in CASES if fast_meta_result(*c) is not None]
    assert len(answered) == 17


def _structure(model_type: str, fast: bool, monkeypatch: pytest.MonkeyPatch):
    from automodel.pipeline import hf_structure, hf_trace

    calls = []
    if not fast:
        monkeypatch.setattr(hf_trace, "fast_meta_result", lambda *a: calls.append(a) and None)
    config = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    structure = hf_structure.trace_hf_structure(model)
    assert fast or calls  # the slow run really went without the fast path
    return structure


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_moe"])
def test_traced_structure_is_the_same_without_the_fast_path(model_type, monkeypatch) -> None:
    fast = _structure(model_type, True, monkeypatch)
    slow = _structure(model_type, False, monkeypatch)
    assert fast == slow


def test_the_tracker_labels_results_of_the_shortcut() -> None:
    from automodel.pipeline.hf_dataflow import SourceTracker

    a, b = _m(2, 3), _m(3)
    tracker = SourceTracker()
    tracker.shortcut = fast_meta_result
    tracker.add([a], ["embed"])
    with tracker:
        out = a * b
    assert out.shape == (2, 3) and tracker.sources([out]) == {"embed"}
