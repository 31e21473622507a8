"""TP before Megatron-FSDP, with automodel.fsdp2's plan resolution (explicit -> HF -> Llama default)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module


def apply_tp(
    model: nn.Module, *, tp_mesh: DeviceMesh, tp_plan: Mapping[str, Any] | str | None = None
) -> dict[str, ParallelStyle]:
    """Shard `model` over `tp_mesh` in place (no sequence parallel); returns the applied plan."""
    from automodel.fsdp2.tp_plan import check_plan_matches_model, resolve_tp_plan, validate_tp_mesh

    validate_tp_mesh(model, tp_mesh)
    plan = resolve_tp_plan(model, tp_plan=tp_plan, sequence_parallel=False)
    check_plan_matches_model(model, plan)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*could not be resolved.*")
        parallelize_module(model, tp_mesh, plan)
    return plan
