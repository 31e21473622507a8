"""TP styles that lay out LoRA adapters with the linear they wrap.

A LoRA-wrapped linear (an ``nn.Linear`` with ``lora_A``/``lora_B`` ``nn.Linear`` children,
y = x W^T + s * (x A^T) B^T) follows the plan key of the linear: the base weight is sharded as the
style says, and the adapters so that no extra collective is needed inside the module:

- colwise (W: Shard(0)): A replicated, B Shard(0)  -> both terms come out Shard(-1)
- rowwise (W: Shard(1)): A Shard(1), B replicated  -> both terms come out Partial (summed by the
  style's output all-reduce / reduce-scatter)
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

from automodel.fsdp2.torch_internals import next_partition_linear
from automodel.fsdp2.tp_styles import TPPlan


def has_lora_adapter(module: nn.Module) -> bool:
    """True for a linear carrying LoRA adapters as ``lora_A``/``lora_B`` ``nn.Linear`` children."""
    return isinstance(getattr(module, "lora_A", None), nn.Linear) and isinstance(
        getattr(module, "lora_B", None), nn.Linear
    )


def _shard_own_params(module: nn.Module, device_mesh: DeviceMesh, placement: Any, src: Any) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = nn.Parameter(
            distribute_tensor(param, device_mesh, [placement], src_data_rank=src),
            requires_grad=param.requires_grad,
        )
        module.register_parameter(name, dist_param)


class _LoRAColwiseMixin(ColwiseParallel):
    """Colwise base weight; ``lora_A`` left replicated, ``lora_B`` sharded on its output rows."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name == "lora_A":
            return  # distribute_module replicates what the partition function leaves alone
        if name == "" and has_lora_adapter(module):
            # torch's colwise function walks every parameter recursively (adapters included)
            _shard_own_params(module, device_mesh, Shard(0), self.src_data_rank)
            return
        next_partition_linear(_LoRAColwiseMixin, self, name, module, device_mesh)


class _LoRARowwiseMixin(RowwiseParallel):
    """Rowwise base weight; ``lora_A`` sharded on its input columns, ``lora_B`` replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name == "lora_B":
            return
        next_partition_linear(
            _LoRARowwiseMixin, self, name, module, device_mesh
        )  # "": W Shard(1), bias R; lora_A: Shard(1)


@functools.cache
def _lora_style_class(style_cls: type) -> type:
    mixin = _LoRAColwiseMixin if issubclass(style_cls, ColwiseParallel) else _LoRARowwiseMixin
    return type(f"LoRA{style_cls.__name__}", (mixin, style_cls), {})


def with_lora_adapters(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> TPPlan:
    """`plan` with its colwise/rowwise styles extended to lay out LoRA adapters too (see above).

    Unchanged when `model` has no LoRA-wrapped linear. The extended styles shard a plain linear
    exactly as before, so a key matching wrapped and unwrapped linears alike is fine.
    """
    if not any(has_lora_adapter(m) for m in model.modules()):
        return dict(plan)
    out: TPPlan = {}
    for key, style in plan.items():
        if isinstance(style, ColwiseParallel | RowwiseParallel) and not isinstance(
            style, _LoRAColwiseMixin | _LoRARowwiseMixin
        ):
            extended = object.__new__(_lora_style_class(type(style)))
            extended.__dict__.update(copy.copy(style.__dict__))  # same layouts and options
            style = extended
        out[key] = style
    return out
