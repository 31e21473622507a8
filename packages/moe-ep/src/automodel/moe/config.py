"""`MoEParallelizerConfig`: the `distributed.moe` section of a recipe (field names and defaults of the seed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from automodel.mesh import parse_dtype


@dataclass(frozen=True)
class MoEParallelizerConfig:
    """How a mixture-of-experts model is sharded, checkpointed and cast under expert parallelism.

    Data only: automodel.moe splits the experts; the FSDP2 strategy (automodel.fsdp2, composed by
    automodel.recipes) reads the other fields when ep_size > 1 for its own FSDP2 and checkpointing.

    ignore_router_for_ac: under activation checkpointing, replay the router's top-k decisions
        saved in the forward instead of recomputing them, so the recomputed forward sends every
        token to the same experts (and the same all-to-all sizes) as the original one.
    reshard_after_forward: FSDP2 frees unsharded parameters after each block's forward (saves
        memory, costs a second all-gather in backward).
    lm_head_precision: when set, the output projection is its own FSDP unit computing in this
        dtype (e.g. float32 logits under a bf16 policy).
    wrap_outer_model: fully_shard the whole model as the root unit (embeddings, final norm, head);
        when False those modules become FSDP units one by one instead.
    mp_policy: FSDP2 ``MixedPrecisionPolicy`` for every unit (None: compute in the parameter dtype).
    """

    ignore_router_for_ac: bool = True
    reshard_after_forward: bool = False
    lm_head_precision: torch.dtype | str | None = None
    wrap_outer_model: bool = True
    mp_policy: MixedPrecisionPolicy | None = None

    def __post_init__(self) -> None:
        for key in ("ignore_router_for_ac", "reshard_after_forward", "wrap_outer_model"):
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be a bool, got {value!r} ({type(value).__name__})")
        # frozen: the normalised dtype is set once, here
        object.__setattr__(
            self, "lm_head_precision", parse_dtype(self.lm_head_precision, key="lm_head_precision")
        )
        if self.mp_policy is not None:
            if not isinstance(self.mp_policy, MixedPrecisionPolicy):
                raise ValueError(
                    f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got {self.mp_policy!r}"
                )
