"""Forward-only runs of a pipeline (evaluation, the check at build time), on every schedule alike.

torch's schedules run evaluation through their training plan with the backward switched off: with
a loss function but no labels the last stage fails while its peers wait for it, and V-shaped
schedules refuse it outright. Forward-only needs no plan: every rank walks the stages in order,
runs the ones it holds micro-batch by micro-batch, and sends each output to the holder of the next
stage (non-blocking, so no two ranks wait on each other).

A stage that raises does not stop the walk: it sends a poison header in place of its outputs, the
stages after it pass the poison on, and at the end every rank of the pp group raises the same
`PipelineStageError` naming the stage and its error; the rank whose stage failed chains the original
exception. No rank is left waiting for a peer that gave up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MAX_TENSORS = 16
MAX_DIMS = 8
_HEADER = 2 + MAX_TENSORS * (2 + MAX_DIMS)
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
_NONE = -1  # dtype code of an output position that holds None


class PipelineStageError(RuntimeError):
    """A pipeline stage raised in its forward; raised on every rank of the pp group alike."""


def _as_tuple(output: Any) -> tuple:
    return output if isinstance(output, tuple) else (output,)


def _header(outputs: tuple | None, device: torch.device) -> torch.Tensor:
    h = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    if outputs is None:
        h[0] = -1  # poison: the stage (or one before it) failed
        return h
    if len(outputs) > MAX_TENSORS:
        raise ValueError(f"a pipeline stage returns {len(outputs)} values; at most {MAX_TENSORS} can be sent")
    h[0], h[1] = 1, len(outputs)
    for i, t in enumerate(outputs):
        base = 2 + i * (2 + MAX_DIMS)
        if t is None:
            h[base] = _NONE
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES or t.dim() > MAX_DIMS:
            raise ValueError(f"a pipeline stage output {i} is not a sendable tensor ({type(t).__name__})")
        h[base], h[base + 1] = _DTYPES.index(t.dtype), t.dim()
        h[base + 2 : base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _from_header(h: torch.Tensor, device: torch.device) -> list[torch.Tensor | None] | None:
    values = h.tolist()
    if values[0] == -1:
        return None
    out: list[torch.Tensor | None] = []
    for i in range(values[1]):
        base = 2 + i * (2 + MAX_DIMS)
        code, ndim = values[base], values[base + 1]
        if code == _NONE:
            out.append(None)
        else:
            shape = values[base + 2 : base + 2 + ndim]
            out.append(torch.empty(shape, dtype=_DTYPES[code], device=device))
    return out


def run_forward(
    *,
    parts: dict[int, nn.Module],
    owner_of_stage: dict[int, int],
    num_stages: int,
    pp_group: dist.ProcessGroup,
    device: torch.device,
    arg_mbs: Sequence[tuple],
    kwarg_mbs: Sequence[dict[str, Any]],
    last_stage_fn: Callable[[int, Any], Any] | None = None,
    on_output: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """Run every micro-batch through the stages; return ``last_stage_fn(mb, output)`` per micro-batch
    on the rank holding the last stage (the raw output without it), ``[]`` elsewhere.

    `parts` maps this rank's stage ids to their modules; `owner_of_stage` gives each stage's pp rank.
    Collective over `pp_group`. Raises `PipelineStageError` on every rank when any stage failed.
    ``on_output(stage, output)`` sees each good stage output (before `last_stage_fn`).
    """
    me = dist.get_rank(pp_group)
    n_mb = len(arg_mbs)
    local: dict[int, list[tuple | None]] = {}
    results: list[Any] = []
    sends: list[Any] = []
    keep: list[torch.Tensor] = []  # tensors in flight stay alive until their sends complete
    error: tuple[int, str] | None = None
    cause: BaseException | None = None
    for s in range(num_stages):
        if owner_of_stage[s] != me:
            continue
        module, outs_of_stage = parts[s], []
        src = owner_of_stage.get(s - 1)
        for mb in range(n_mb):
            if s == 0:
                inputs: tuple | None = tuple(arg_mbs[mb])
            elif src == me:
                inputs = local[s - 1][mb]
            else:
                inputs = _recv(src, pp_group, device)
            output: Any = None
            if inputs is not None and error is None:
                try:
                    output = module(*inputs, **kwarg_mbs[mb])
                    if on_output is not None:
                        on_output(s, output)
                    if s == num_stages - 1 and last_stage_fn is not None:
                        output = last_stage_fn(mb, output)
                except Exception as e:  # noqa: BLE001 - reported on every rank below
                    error, cause = (s, f"{type(e).__name__}: {e}"), e
                    output = None
            ok = inputs is not None and error is None
            if s == num_stages - 1:
                results.append(output if ok else None)
                continue
            sent = _as_tuple(output) if ok else None
            if owner_of_stage[s + 1] == me:
                outs_of_stage.append(sent)
            else:
                dst = dist.get_global_rank(pp_group, owner_of_stage[s + 1])
                header = _header(sent, device)
                keep.append(header)
                sends.append(dist.isend(header, dst=dst, group=pp_group))
                for t in sent or ():
                    if t is not None:
                        t = t.detach().contiguous()
                        keep.append(t)
                        sends.append(dist.isend(t, dst=dst, group=pp_group))
        local[s] = outs_of_stage
    for work in sends:
        work.wait()
    _agree(error, cause, pp_group)
    return results


def _recv(src_pp_rank: int, group: dist.ProcessGroup, device: torch.device) -> tuple | None:
    src = dist.get_global_rank(group, src_pp_rank)
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    buffers = _from_header(header, device)
    if buffers is None:
        return None
    for t in buffers:
        if t is not None:
            dist.recv(t, src=src, group=group)
    return tuple(buffers)


def _agree(error: tuple[int, str] | None, cause: BaseException | None, group: dist.ProcessGroup) -> None:
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, error, group=group)
    failures = [(rank, e) for rank, e in enumerate(gathered) if e is not None]
    if not failures:
        return
    rank, (stage, message) = failures[0]
    raise PipelineStageError(
        f"pipeline stage {stage} (pp rank {rank}) failed in its forward: {message}. Every pp rank stops "
        "here; check the stage's inputs (shapes, dtypes, the kwargs it needs) or the modules given to it "
        "(module_fqns_per_model_part)"
    ) from cause
