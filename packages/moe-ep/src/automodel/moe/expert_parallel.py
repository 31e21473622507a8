"""`apply_ep`: shard experts ``Shard(0)`` over the ep mesh and route their rows to the owner ranks.

Parameter names stay the Hugging Face ones (``...experts.gate_up_proj``, ``..._bias``): every
expert parameter becomes a DTensor of the full [E, ...] shape whose local shard is this rank's
E/ep experts, so gathered state dicts and HF checkpoints line up key for key and shape for shape.
Flat rows held by a descendant (DBRX's ``experts.mlp.w1`` [E*F, H]) are split the same way:
Shard(0) of E blocks of F rows gives each rank its experts' blocks.
Routers are not touched: they run on every rank (their logits still feed the auxiliary loss).

Each call exchanges the rows an experts module is given with the ranks owning their experts
(`dispatch`), computes them on the owner, and sends the results back:

- SwiGLU layout: the grouped-GEMM fast path (`grouped_gemm`), then the router-weighted sum.
- any other index-routed layout: the module's own forward on the received rows, with local
  expert ids and unit weights (`own_forward`), then the router-weighted sum.
- rows sorted by expert (JetMoE) or in one block per expert (Llama 4): the module's own forward
  on the received rows; results return to their original positions.
- experts as embedding rows (Doge): each lookup fetches its rows from their owners (`expert_tables`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from automodel.moe.dispatch import (
    DispatchPlan,
    combine_tokens,
    dispatch_tokens,
    plan_dispatch,
    return_tokens,
    unsort_rows,
)
from automodel.moe.expert_tables import ExpertParallelEmbedding
from automodel.moe.grouped_gemm import grouped_expert_mlp
from automodel.moe.model_inspect import (
    ExpertsLayout,
    MoEBlock,
    check_expert_parallel_support,
    expert_parameter,
)
from automodel.moe.own_forward import call_own_forward, local_view, verify_own_forward


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


class ExpertParallelExperts(nn.Module):
    """Mixin placed in front of an HF experts class: same call, rows computed by their experts' owners.

    The generated subclass sets `_ep_layout`, `_ep_param_names` (dotted for a descendant's
    parameter) and `_ep_base_forward` (the HF class's forward); `apply_ep` sets `_ep_mesh` and
    `_ep_num_experts` (E: the expert parameters' rows may be E blocks of k rows).
    """

    _ep_mesh: DeviceMesh
    _ep_num_experts: int
    _ep_layout: ExpertsLayout
    _ep_param_names: tuple[str, ...]
    _ep_base_forward: Any
    #: None until the first forward verified the own forward (and whether the fast path matches it).
    _ep_fast_path: bool | None = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs:  # the HF call by keyword: bind to the base forward's positional order
            bound = inspect.signature(self._ep_base_forward).bind(self, *args, **kwargs)
            args = tuple(bound.arguments.values())[1:]
        if self._ep_layout in (ExpertsLayout.SWIGLU, ExpertsLayout.INDEX_ROUTED):
            return self._forward_index_routed(*args)
        if self._ep_layout is ExpertsLayout.SORTED_ROWS:
            return self._forward_rows(args[0], self._ids_of_sorted_rows(args[0], args[1]))
        return self._forward_rows(args[0], self._ids_of_blocks(args[0]))

    # ---- helpers ------------------------------------------------------------------------------
    @property
    def _num_experts(self) -> int:
        return self._ep_num_experts

    @property
    def _num_local_experts(self) -> int:
        return self._ep_num_experts // self._ep_mesh.size()

    def _local_params(self) -> dict[str, torch.Tensor]:
        return {name: _local(expert_parameter(self, name)) for name in self._ep_param_names}

    def _ids_of_sorted_rows(self, rows: torch.Tensor, expert_size: Any) -> torch.Tensor:
        sizes = torch.as_tensor(expert_size, device=rows.device)
        return torch.repeat_interleave(torch.arange(self._num_experts, device=rows.device), sizes)

    def _ids_of_blocks(self, rows: torch.Tensor) -> torch.Tensor:
        experts = self._num_experts
        assert rows.shape[0] % experts == 0, f"{rows.shape[0]} rows do not split into {experts} expert blocks"
        return torch.arange(experts, device=rows.device).repeat_interleave(rows.shape[0] // experts)

    def _swiglu(self, params: dict[str, torch.Tensor]):  # noqa: ANN202
        def run(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
            return grouped_expert_mlp(
                rows,
                counts=counts,
                gate_up_proj=params["gate_up_proj"],
                down_proj=params["down_proj"],
                act_fn=self.act_fn,
            )

        return run

    def _verify_once(
        self, sample: torch.Tensor, params: dict[str, torch.Tensor], weight_dtype: torch.dtype
    ) -> None:
        if self._ep_fast_path is not None:
            return
        swiglu = self._ep_layout is ExpertsLayout.SWIGLU
        matches = verify_own_forward(
            self._ep_base_forward,
            self,
            layout=self._ep_layout,
            params=params,
            local=self._num_local_experts,
            sample=sample,
            weight_dtype=weight_dtype,
            group=self._ep_mesh.get_group(),
            fast_path=self._swiglu(params) if swiglu else None,
        )
        self._ep_fast_path = swiglu and matches

    def _compute(
        self,
        received: torch.Tensor,
        plan: DispatchPlan,
        params: dict[str, torch.Tensor],
        weight_dtype: torch.dtype,
    ) -> torch.Tensor:
        """This rank's experts on the rows it received (grouped by local expert)."""
        counts = plan.local_counts
        if self._ep_fast_path:
            return self._swiglu(params)(received, counts)
        local = len(counts)
        rows = received
        if received.shape[0] == 0:
            # No rows: zero dummy rows appended to the (empty) received buffer keep both the
            # parameters and the dispatch all-to-all in the graph, so every rank runs the same
            # collectives in backward (their gradients are zero).
            counts = (
                [1] * local if self._ep_layout is ExpertsLayout.EXPERT_BLOCKS else [1] + [0] * (local - 1)
            )
            rows = F.pad(received, (0, 0, 0, sum(counts)))
        view = local_view(self, params=params, num_experts=local)
        out = call_own_forward(
            self._ep_base_forward,
            view,
            layout=self._ep_layout,
            rows=rows,
            counts=counts,
            weight_dtype=weight_dtype,
        )
        return out[: received.shape[0]]

    # ---- the three calling conventions ----------------------------------------------------------
    def _forward_index_routed(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        group = self._ep_mesh.get_group()
        params = self._local_params()
        # one row per routed token (DBRX passes [B, S, H] with [B*S, K] indices); out as given
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        self._verify_once(tokens, params, top_k_weights.dtype)
        plan = plan_dispatch(top_k_index, num_experts=self._num_experts, group=group)
        received = dispatch_tokens(tokens, plan, group=group)
        outputs = self._compute(received, plan, params, top_k_weights.dtype)
        combined = combine_tokens(
            outputs,
            plan,
            top_k_weights=top_k_weights,
            num_tokens=tokens.shape[0],
            out_dtype=hidden_states.dtype,
            group=group,
        )
        return combined.view(hidden_states.shape)

    def _forward_rows(self, rows: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """Rows with one expert each (sorted rows, expert blocks): out row i is row i's expert output."""
        group = self._ep_mesh.get_group()
        params = self._local_params()
        self._verify_once(rows, params, rows.dtype)
        plan = plan_dispatch(expert_of_row.unsqueeze(-1), num_experts=self._num_experts, group=group)
        received = dispatch_tokens(rows, plan, group=group)
        outputs = self._compute(received, plan, params, rows.dtype)
        return unsort_rows(return_tokens(outputs, plan, group=group), plan)


def _shard_experts(experts: nn.Module, names: tuple[str, ...], ep_mesh: DeviceMesh) -> None:
    """Each named parameter (dotted: a descendant's) becomes Shard(0) over ep; with E | ep its
    rows split at expert boundaries, also for E blocks of k rows."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        owner = experts.get_submodule(prefix)
        param = owner.get_parameter(leaf)
        local = param.shape[0] // ep
        shard = param.detach()[rank * local : (rank + 1) * local].clone()
        dtensor = DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)
        owner.register_parameter(leaf, nn.Parameter(dtensor, requires_grad=param.requires_grad))


def _expert_parallel_class(base: type, block: MoEBlock, cache: dict[tuple, type]) -> type:
    key = (base, block.layout, block.param_names)
    if key not in cache:
        attrs = {
            "_ep_layout": block.layout,
            "_ep_param_names": block.param_names,
            "_ep_base_forward": staticmethod(base.forward),
        }
        mixin = (
            ExpertParallelEmbedding if block.layout is ExpertsLayout.EXPERT_ROWS else ExpertParallelExperts
        )
        cache[key] = type(f"ExpertParallel{base.__name__}", (mixin, base), attrs)
    return cache[key]


def apply_ep(model: nn.Module, *, ep_mesh: DeviceMesh) -> list[MoEBlock]:
    """Make every experts module of `model` expert parallel over the 1-D `ep_mesh`.

    Every rank must hold the same full expert weights before the call (same seed, or meta
    tensors to be materialized later); each keeps its E/ep slice. Returns the experts touched.
    Raises ValueError for experts modules expert parallelism cannot split (see `model_inspect`).
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"ep_mesh must be 1-D, got a {ep_mesh.ndim}-D mesh {ep_mesh.mesh_dim_names}")
    ep = ep_mesh.size()
    blocks = check_expert_parallel_support(model)
    classes: dict[tuple, type] = {}
    for block in blocks:
        if block.num_experts % ep != 0:
            raise ValueError(
                f"ep_size={ep} must divide the number of experts, but {block.experts_name} has {block.num_experts}"
            )
        if any(isinstance(expert_parameter(block.experts, n), DTensor) for n in block.param_names):
            raise ValueError(f"{block.experts_name} is already sharded (its parameters are DTensors)")
        _shard_experts(block.experts, block.param_names, ep_mesh)
        block.experts.__class__ = _expert_parallel_class(type(block.experts), block, classes)
        block.experts._ep_mesh = ep_mesh
        block.experts._ep_num_experts = block.num_experts
        block.experts._is_expert_parallel = True
    return blocks
