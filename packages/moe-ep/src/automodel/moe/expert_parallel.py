"""`apply_ep`: shard stacked experts ``Shard(0)`` over the ep mesh and route tokens to their owners.

Parameter names stay the Hugging Face ones (``...experts.gate_up_proj``): the parameters become
DTensors of the full [E, ...] shape whose local shard is this rank's E/ep experts, so gathered
state dicts and HF checkpoints line up key for key and shape for shape. The router is not
touched: it runs on every rank (its logits still feed the auxiliary load-balancing loss).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from automodel.moe.dispatch import combine_tokens, dispatch_tokens, plan_dispatch
from automodel.moe.grouped_gemm import grouped_expert_mlp
from automodel.moe.model_inspect import MoEBlock, check_supported_experts, find_moe_blocks

EXPERT_PARAM_NAMES: tuple[str, ...] = ("gate_up_proj", "down_proj")


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


class ExpertParallelExperts(nn.Module):
    """Mixin placed in front of an HF experts class: same signature, tokens computed by their owner rank."""

    _ep_mesh: DeviceMesh

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        group = self._ep_mesh.get_group()
        num_experts = self.gate_up_proj.shape[0]
        plan = plan_dispatch(top_k_index, num_experts=num_experts, group=group)
        received = dispatch_tokens(hidden_states, plan, group=group)
        outputs = grouped_expert_mlp(
            received,
            counts=plan.local_counts,
            gate_up_proj=_local(self.gate_up_proj),
            down_proj=_local(self.down_proj),
            act_fn=self.act_fn,
        )
        return combine_tokens(
            outputs,
            plan,
            top_k_weights=top_k_weights,
            num_tokens=hidden_states.shape[0],
            out_dtype=hidden_states.dtype,
            group=group,
        )


def _shard_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in EXPERT_PARAM_NAMES:
        param = experts._parameters[name]
        local = param.shape[0] // ep
        shard = param.detach()[rank * local : (rank + 1) * local].clone()
        dtensor = DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)
        experts.register_parameter(name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


def apply_ep(model: nn.Module, *, ep_mesh: DeviceMesh) -> list[MoEBlock]:
    """Make every stacked-experts module of `model` expert parallel over the 1-D `ep_mesh`.

    Every rank must hold the same full expert weights before the call (same seed, or meta
    tensors to be materialized later); each keeps its E/ep slice. Returns the blocks touched.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"ep_mesh must be 1-D, got a {ep_mesh.ndim}-D mesh {ep_mesh.mesh_dim_names}")
    ep = ep_mesh.size()
    blocks = find_moe_blocks(model)
    classes: dict[type, type] = {}
    for block in blocks:
        experts_name = f"{block.name}.experts" if block.name else "experts"
        check_supported_experts(experts_name, block.experts)
        if block.num_experts % ep != 0:
            raise ValueError(
                f"ep_size={ep} must divide the number of experts, but {experts_name} has {block.num_experts}"
            )
        if any(isinstance(block.experts._parameters[n], DTensor) for n in EXPERT_PARAM_NAMES):
            raise ValueError(f"{experts_name} is already sharded (its parameters are DTensors)")
        _shard_experts(block.experts, ep_mesh)
        base = type(block.experts)
        if base not in classes:
            classes[base] = type(f"ExpertParallel{base.__name__}", (ExpertParallelExperts, base), {})
        block.experts.__class__ = classes[base]
        block.experts._ep_mesh = ep_mesh
        block.experts._is_expert_parallel = True
    return blocks
