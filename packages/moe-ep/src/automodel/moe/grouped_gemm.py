"""Local experts as one grouped GEMM: every expert's tokens in one call instead of a loop over experts.

``torch.nn.functional.grouped_mm`` (public since torch 2.11) takes tokens sorted by expert plus the cumulative token counts (``offs``).
It exists on CUDA (bf16, sm90+) and on CPU in recent torch builds; where it is missing, or the
shapes break its 16-byte stride rule, a per-expert loop computes the same thing. Under
``torch.compile`` the loop also stands in for other dtypes than bf16: torch's meta kernel for
``_grouped_mm`` (what the tracer runs) accepts bf16 inputs only, even where the eager CPU kernel
multiplies fp32 (torch 2.13).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F


@cache
def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    # A capability, not state: whether this torch build has a grouped-mm kernel for (device, dtype).
    if not hasattr(F, "grouped_mm"):
        return False
    if device_type == "cuda":
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
            return False
    try:
        x = torch.ones(8, 16, device=device_type, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device_type, dtype=dtype)
        offs = torch.tensor([4, 8], device=device_type, dtype=torch.int32)
        F.grouped_mm(x, w, offs=offs)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` can multiply `x` by each of `weights` on this device and dtype."""
    if any(w.dtype != x.dtype or w.device != x.device for w in weights):
        return False
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False  # the tracer's meta kernel refuses it ("Expected inputs of BF16 type")
    align = 16 // x.element_size()
    if any(size % align for w in weights for size in w.shape[1:]) or x.shape[-1] % align:
        return False
    return _probe_grouped_mm(x.device.type, x.dtype)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands a contiguous gradient on (grouped_mm's backward rejects expanded ones)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad.contiguous()


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # weight is [G, out, in] (nn.Linear layout); grouped_mm wants [G, in, out].
    return _ContiguousGrad.apply(F.grouped_mm(x, weight.transpose(-2, -1), offs=offs))


def _looped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    parts = [F.linear(chunk, weight[g]) for g, chunk in enumerate(x.split(counts))]
    return torch.cat(parts) if parts else x.new_empty(0, weight.shape[1])


def grouped_expert_mlp(
    x: torch.Tensor,
    *,
    counts: list[int],
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """SwiGLU-style experts on tokens sorted by expert: ``down(act(gate(x)) * up(x))`` per group.

    `x` is [sum(counts), H]; `gate_up_proj` [G, 2I, H] and `down_proj` [G, H, I] hold the G local
    experts; `counts[g]` tokens belong to expert g. `use_grouped_mm=None` picks the grouped kernel
    where supported.
    """
    assert len(counts) == gate_up_proj.shape[0] == down_proj.shape[0], (counts, gate_up_proj.shape)
    assert x.shape[0] == sum(counts), (x.shape, counts)
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x, gate_up_proj, down_proj)
    if use_grouped_mm:
        offs = torch.tensor(counts, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        gate, up = _grouped_linear(x, gate_up_proj, offs).chunk(2, dim=-1)
        return _grouped_linear(act_fn(gate) * up, down_proj, offs)
    gate, up = _looped_linear(x, gate_up_proj, counts).chunk(2, dim=-1)
    return _looped_linear(act_fn(gate) * up, down_proj, counts)
