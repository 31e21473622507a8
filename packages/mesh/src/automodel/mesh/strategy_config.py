"""`StrategyConfig`: the typed base of every strategy's flags (FSDP2, DDP, Megatron-FSDP, single).

The cross-cutting facts that code outside a strategy reads (the planner's memory terms, the model
rules, the layout report) are answered here the same way for every strategy, as typed attributes:
no ``getattr(config, "sequence_parallel", False)`` on a config of unknown class. A strategy's own
flags stay fields of its subclass (whose constructor arguments are the accepted YAML flags); the
base adds no field, so it accepts no YAML key of its own.

Tensor and sequence parallelism's options are not a strategy's: they are the recipes' tp
parallelism's own typed config (`automodel.fsdp2.TensorParallelConfig`).

A fact only some strategies have a flag for (`backend`, `patch_is_packed_sequence`) is a property
here answering "none"; a subclass answers it with a field of the
same name and a plain default, whose class attribute hides the property (a field without one would
leave the property in place and fail loudly in ``__init__``: the property has no setter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class StrategyConfig:
    """Frozen: a strategy's flags are one value, built once (machine defaults give a new one)."""

    #: This strategy's boolean flags that apply to each decoder layer (activation checkpointing,
    #: per-layer compile, prefetch): they need the model's layer list.
    LAYER_FLAGS: ClassVar[tuple[str, ...]] = ()

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the forward and backward compute in; None: the model's own parameter dtype."""
        return None

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in across data-parallel ranks; None: the compute dtype."""
        return None

    @property
    def backend(self) -> str | None:
        """The process-group backend the strategy's flags name (nccl / gloo); None: they name none."""
        return None

    @property
    def patch_is_packed_sequence(self) -> bool:
        """Whether transformers' packed-sequence probe is replaced (FSDP2's flag); False elsewhere."""
        return False

    @property
    def enabled_layer_flags(self) -> tuple[str, ...]:
        """The `LAYER_FLAGS` that are on."""
        return tuple(name for name in self.LAYER_FLAGS if getattr(self, name) is True)
