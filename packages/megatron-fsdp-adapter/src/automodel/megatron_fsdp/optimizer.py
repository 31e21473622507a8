"""Hand an optimizer over to Megatron-FSDP without changing what it computes.

megatron-fsdp's own `fully_shard` re-creates the optimizer's param groups from
``optimizer.defaults`` (losing per-group weight decay or lr) and runs one eager step on zero
gradients to create the state for checkpoint loading; for AdamW that step applies weight decay
and advances the bias-correction counter, so training no longer matches FSDP2. Here the groups
keep their hyper-parameters and the eager step runs at lr 0 with step counters reset after it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from automodel.mesh.model_parts import canonical_fqn


def rebind_param_groups(
    optimizer: torch.optim.Optimizer, *, old_names: Mapping[int, str], new_params: Mapping[str, nn.Parameter]
) -> None:
    """Point each param group at the new parameter of the same name (by ``id`` of the old one).

    TP and megatron-fsdp replace parameter objects, so an optimizer built before them would step
    stale tensors; names as the bare model has them (`canonical_fqn`: wrapper atoms ignored)
    identify the replacement.
    """
    new_params = {canonical_fqn(n): p for n, p in new_params.items()}
    old_names = {i: canonical_fqn(n) for i, n in old_names.items()}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        params = []
        for p in group["params"]:
            name = old_names.get(id(p))
            if name is None or name not in new_params:
                raise ValueError(
                    f"optimizer param_groups[{index}] holds a parameter that is not a parameter of the model "
                    f"being sharded ({name or 'unnamed'}); build the optimizer on model.parameters()"
                )
            params.append(new_params[name])
        # "params" first: megatron-fsdp's fully_shard_optimizer reads a group's parameters from
        # its first key.
        groups.append({"params": params, **{k: v for k, v in group.items() if k != "params"}})
    optimizer.param_groups.clear()
    optimizer.state.clear()
    for group in groups:
        optimizer.add_param_group(group)


@contextmanager
def neutral_state_init(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Steps taken inside leave parameters unchanged and state as if no step had happened.

    lr is 0 inside (so no update and no decoupled weight decay); on exit lr is restored, state
    tensors are zeroed and ``step`` counters reset. Exact for the Adam family and plain SGD.
    """
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif key == "step":
                    state[key] = 0
