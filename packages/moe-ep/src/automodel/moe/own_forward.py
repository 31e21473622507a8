"""Run an experts module's own forward on this rank's experts, and check once that doing so is exact.

After `apply_ep` an experts module's parameters are DTensors of the full [E, ...] shape (or
[E*k, ...] flat rows held by a descendant, DBRX's ``mlp.w1``) whose local shard holds this rank's
L = E/ep experts. Its own forward (the model's code, including the implementation transformers'
``config._experts_implementation`` picks) indexes those parameters by expert id and may read
``num_experts``. `local_view` gives it a shallow copy whose parameters (and those of copies of the
descendants holding them) are the local [L, ...] / [L*k, ...] tensors (autograd flows back to the
DTensors) and whose ``num_experts`` is L, so local ids 0..L-1 address this rank's experts.

Expert parallelism splits one call into per-owner calls on regrouped rows, which is exact only
if (a) each output row depends on its own input row and expert alone, (b) parameter row e is
expert e, and (c) for index-routed experts, the routing weight scales the expert's output
(linear, applied after the expert). `verify_own_forward` checks all three on a few rows at the
first forward and raises on every rank, naming the class, instead of training on a wrong loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from automodel.moe.model_inspect import ExpertsLayout
from automodel.moe.torch_internals import hook_free_copy

#: Probe rows per local expert.
_ROWS = 2


def local_view(module: nn.Module, *, params: dict[str, torch.Tensor], num_experts: int) -> nn.Module:
    """A hook-free shallow copy of `module` holding `params` (names as `MoEBlock.param_names`,
    dotted for a descendant's) as its parameters, and `num_experts` experts."""
    view = hook_free_copy(module, params)
    if isinstance(module.__dict__.get("num_experts"), int):
        view.__dict__["num_experts"] = num_experts
    # transformers' own EP flag means "sentinel ids may be present"; a local view receives none.
    if "_is_expert_parallel" in view.__dict__:
        view.__dict__["_is_expert_parallel"] = False
    return view


def call_own_forward(
    base_forward: Callable[..., torch.Tensor],
    view: nn.Module,
    *,
    layout: ExpertsLayout,
    rows: torch.Tensor,
    counts: Sequence[int],
    weights: torch.Tensor | None = None,
    weight_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`base_forward` on `rows` grouped by local expert (`counts[e]` rows for expert e), in its convention.

    Index-routed experts get each row's local expert id and its weight (`weights`, default ones:
    the router's weights are applied after the rows come back).
    """
    if layout in (ExpertsLayout.INDEX_ROUTED, ExpertsLayout.SWIGLU):
        sizes = torch.as_tensor(list(counts), device=rows.device)
        ids = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), sizes).unsqueeze(-1)
        if weights is None:
            weights = torch.ones(ids.shape, dtype=weight_dtype or rows.dtype, device=rows.device)
        out = base_forward(view, rows, ids, weights.reshape(ids.shape))
    elif layout is ExpertsLayout.SORTED_ROWS:
        out = base_forward(view, rows, list(counts))
    else:
        assert len(set(counts)) <= 1, f"expert blocks must be equal, got {counts}"
        out = base_forward(view, rows)
    # One output row per input row: DBRX's forward restores its input's leading dims from the
    # first ([B, S, H] -> [B, -1, H]), so N rows come back as [N, 1, H].
    return out.reshape(rows.shape[0], out.shape[-1]) if out.dim() > 2 else out


def _expert_rows(params: dict[str, torch.Tensor], expert: int, local: int) -> dict[str, torch.Tensor]:
    """Expert `expert`'s rows of each of `local` experts' parameters: row e, or block e of k rows."""
    blocks = {n: p.shape[0] // local for n, p in params.items()}
    return {n: p[expert * blocks[n] : (expert + 1) * blocks[n]] for n, p in params.items()}


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape:
        return False
    rtol = 1e-4 if want.dtype in (torch.float32, torch.float64) else 5e-2
    scale = want.abs().max().clamp_min(1e-6)
    return bool(((got.float() - want.float()).abs().max() <= rtol * scale).item())


#: Verdict bits; each is all-reduced over the ep group so every rank decides alike.
_ROW_MIXING, _INDEXING, _NONLINEAR_WEIGHT, _FAST_PATH_DIFFERS = 1, 2, 4, 8


#: Bounds of the probe rows' scale: the experts' inputs (normed hidden states) are of order 1.
_SCALE_RANGE = (1e-3, 1e2)


def _row_scale(sample: torch.Tensor) -> float:
    """The spread of `sample`'s finite entries, kept within `_SCALE_RANGE` (1 where it has none).

    A pipeline stage's first calls may carry placeholder values: NaN hidden states on a later
    stage's shape pass, or never-written receive buffers (seen at 1e18). Rows scaled by those
    overflow in the experts and would fail every check of a sound forward; every rank still runs
    the probe at the same call, so none may skip it.
    """
    finite = sample.detach().float().flatten()
    finite = finite[torch.isfinite(finite)]
    scale = finite.std().item() if finite.numel() > 1 else 0.0
    if not (scale > 0 and math.isfinite(scale)):
        return 1.0
    low, high = _SCALE_RANGE
    return min(max(scale, low), high)


def _local_verdict(
    base_forward: Callable[..., torch.Tensor],
    module: nn.Module,
    *,
    layout: ExpertsLayout,
    params: dict[str, torch.Tensor],
    local: int,
    sample: torch.Tensor,
    weight_dtype: torch.dtype,
    fast_path: Callable[[torch.Tensor, list[int]], torch.Tensor] | None,
) -> int:
    g = torch.Generator().manual_seed(1234)
    x = (torch.randn(local * _ROWS, sample.shape[-1], generator=g) * _row_scale(sample)).to(sample)
    counts = [_ROWS] * local

    def run(rows: torch.Tensor, sizes: list[int], view: nn.Module, weights: torch.Tensor | None = None):
        return call_own_forward(
            base_forward,
            view,
            layout=layout,
            rows=rows,
            counts=sizes,
            weights=weights,
            weight_dtype=weight_dtype,
        )

    full = local_view(module, params=params, num_experts=local)
    ref = run(x, counts, full)
    verdict = 0
    for i in range(_ROWS):  # (a) every row alone gives the row it gave in the batch
        if not _close(run(x[i::_ROWS], [1] * local, full), ref[i::_ROWS]):
            verdict |= _ROW_MIXING
    for e in sorted({0, local - 1}):  # (b) parameter row e (block e of k rows) alone computes expert e
        one = local_view(module, params=_expert_rows(params, e, local), num_experts=1)
        rows = slice(e * _ROWS, (e + 1) * _ROWS)
        if not _close(run(x[rows], [_ROWS], one), ref[rows]):
            verdict |= _INDEXING
    if layout in (ExpertsLayout.INDEX_ROUTED, ExpertsLayout.SWIGLU):  # (c) output scaled by the weight
        w = torch.linspace(0.25, 1.75, x.shape[0], dtype=weight_dtype, device=x.device)
        if not _close(run(x, counts, full, w), ref * w.to(ref.dtype).unsqueeze(-1)):
            verdict |= _NONLINEAR_WEIGHT
    if fast_path is not None and not _close(fast_path(x, counts), ref):
        verdict |= _FAST_PATH_DIFFERS
    return verdict


@torch.no_grad()
def verify_own_forward(
    base_forward: Callable[..., torch.Tensor],
    module: nn.Module,
    *,
    layout: ExpertsLayout,
    params: dict[str, torch.Tensor],
    local: int,
    sample: torch.Tensor,
    weight_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    fast_path: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
) -> bool:
    """Check (a)-(c) of the module docstring on this rank's `local` experts; returns whether
    `fast_path` agrees.

    `sample` gives the rows' width, dtype, device and scale. Every rank of `group` must call
    this at the same forward (one small all-reduce), and all raise or return alike.
    """
    params = {n: p.detach() for n, p in params.items()}
    verdict = _local_verdict(
        base_forward,
        module,
        layout=layout,
        params=params,
        local=local,
        sample=sample.detach(),
        weight_dtype=weight_dtype,
        fast_path=fast_path,
    )
    bits = (_ROW_MIXING, _INDEXING, _NONLINEAR_WEIGHT, _FAST_PATH_DIFFERS)
    flags = torch.tensor([int(bool(verdict & b)) for b in bits], dtype=torch.int64, device=sample.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)  # any rank's failure, per check
    verdict = sum(b for b, f in zip(bits, flags.tolist(), strict=True) if f)
    name = type(module).__name__.removeprefix("FSDP").removeprefix("ExpertParallel")
    reasons = {
        _ROW_MIXING: "an output row depends on other rows of the call",
        _INDEXING: "parameter row e does not compute expert e on its own (it reads other experts' rows)",
        _NONLINEAR_WEIGHT: "its output is not the expert output scaled by the routing weight (the weight "
        "enters before a non-linearity or is not applied per row)",
    }
    failed = [text for bit, text in reasons.items() if verdict & bit]
    if failed:
        raise ValueError(
            f"expert parallelism cannot run {name}'s own forward on regrouped tokens: "
            + "; ".join(failed)
            + ". Running it split over ranks would give a different loss; use ep_size=1 for this model"
        )
    return not verdict & _FAST_PATH_DIFFERS
