"""The megatron-fsdp strategy: TP -> MLP activation checkpointing -> weights -> megatron-fsdp (CUDA
only, at every dp size); megatron-fsdp drives the optimizer step, the gradient sync and the norm."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from automodel.fsdp2 import TensorParallelConfig
from automodel.megatron_fsdp import (
    MegatronFSDPConfig,
    MegatronFSDPManager,
    MegatronFSDPUnavailableError,
    check_tensor_parallel,
    clip_grad_norm,
    import_megatron_fsdp,
    is_megatron_fsdp,
    microbatch_grad_sync,
    model_state_dict,
    parameter_buffers,
    shard_optimizer,
)
from automodel.megatron_fsdp import full_tensor as megatron_full_tensor
from automodel.mesh import MeshContext
from automodel.recipes.errors import ConfigError
from automodel.recipes.parallelisms import config_error
from automodel.recipes.parallelisms.tp import tensor_parallel_config
from automodel.recipes.planning.step import StrategyMemory
from automodel.recipes.strategies.base import Initialize, ParallelModel, Strategy

if TYPE_CHECKING:
    from automodel.recipes.config.distributed import DistributedSection
    from automodel.recipes.parallelisms import Parallelism


class MegatronFSDPStrategy(Strategy[MegatronFSDPConfig]):
    """automodel.megatron_fsdp's adapter around megatron-fsdp's ``fully_shard``."""

    name = "megatron_fsdp"
    # cp is not listed: this strategy applies no context-parallel hooks to the model, so each cp
    # rank would attend over the whole sequence (a layout that silently does nothing is refused)
    supported_axes = ("dp_shard", "tp")
    # it checkpoints the MLPs of its unit modules (checked by the adapter), not each decoder layer
    layer_flags = ()
    # it unshards the LM head only inside its own forward (CUDA only, unchecked on CPU)
    head_weight_readable = False
    float8_linears = False  # megatron-fsdp's buffers hold plain tensors, not torchao's float8 subclasses

    def config_class(self) -> type[MegatronFSDPConfig]:
        return MegatronFSDPConfig

    def memory_model(self, config: MegatronFSDPConfig) -> StrategyMemory:
        """Sharded over every dp and cp rank by ZeRO stage (``zero_dp_strategy``); fp32 gradients
        and master weights when asked; two layers' buckets unsharded."""
        shards = config.data_parallel_sharding_strategy.split("_")  # megatron-fsdp's name: what it shards
        return StrategyMemory(
            shard_over="rows",
            params_sharded="params" in shards,
            grads_sharded="grads" in shards,
            optimizer_sharded="optim" in shards,
            grad_bytes=4 if config.grad_reduce_in_fp32 else None,
            fp32_master=bool(config.preserve_fp32_weights),
            gathered_weights="two_layers",
            reduce_scatter_in_flight=False,
            defer_unsharded_grads=False,
        )

    def check_environment(self, config: MegatronFSDPConfig) -> None:
        """megatron-fsdp must import (it needs CUDA at run time)."""
        try:
            import_megatron_fsdp()
        except MegatronFSDPUnavailableError as e:
            raise ConfigError("distributed.strategy", self.name, str(e)) from None

    def axis_refusal(self, parallelism: Parallelism) -> str:
        if parallelism.holds_whole_copies:  # HSDP's replicas of a sharded model
            return f"is FSDP2-only (strategy={self.name})"
        if parallelism.splits_tokens:  # cp: its attention hooks are applied by fsdp2's stack only
            return (
                f"strategy {self.name} splits no attention over {parallelism.name} here (each "
                f"{parallelism.name} rank would attend over the whole sequence); use strategy fsdp2 "
                f"for {parallelism.size_key} > 1"
            )
        return "megatron_fsdp does not support it (must be 1)"

    def check_sizes(
        self, sizes: dict[str, int | None], options: dict[str, Any], config: MegatronFSDPConfig
    ) -> None:
        if config.init_fsdp_with_meta_device:
            raise ConfigError(
                "distributed.init_fsdp_with_meta_device",
                True,
                "is not supported by the recipes: they initialise (or load) the TP-sharded weights "
                "before megatron-fsdp wraps the model, identically to fsdp2; set it to false",
            )

    def check_parallelism_config(self, config: object, *, options: Mapping[str, object]) -> None:
        """megatron-fsdp applies TP inside its own wrapper, without sequence parallelism: the TP
        options it cannot honour are refused by the adapter's rule, naming the key."""
        if isinstance(config, TensorParallelConfig):
            try:
                check_tensor_parallel(config)
            except ValueError as e:
                raise config_error("distributed", options, e) from None

    def parallelize(
        self,
        model: nn.Module,
        *,
        mesh: MeshContext,
        section: DistributedSection,
        device: torch.device,
        initialize: Initialize,
        gradient_divide_factor: float | None,
        pipeline_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    ) -> ParallelModel:
        """TP (with the tp parallelism's own config) -> MLP checkpointing -> weights -> megatron-fsdp."""
        manager = MegatronFSDPManager(
            section.strategy_config,
            mesh,
            gradient_divide_factor=gradient_divide_factor,
            tensor_parallel=tensor_parallel_config(section.parallelism_configs),
        )
        try:
            wrapped, _ = manager.parallelize(model, materialize=lambda m: initialize([m]))
        except MegatronFSDPUnavailableError as e:
            raise ConfigError("distributed.strategy", self.name, str(e)) from None
        return ParallelModel(parts=[wrapped], strategy=self, defer_grad_sync=True)

    def unwrap(self, part: nn.Module) -> nn.Module:
        return part.get_submodule("module") if is_megatron_fsdp(part) else part

    def state_module(self, part: nn.Module) -> nn.Module:
        """The inner module, its parameters swapped back to the distributed ones the optimizer holds."""
        if not is_megatron_fsdp(part):
            return part
        part._replace_param_with_distributed_if_needed()  # pyright: ignore[reportCallIssue]  # megatron-fsdp's method
        return part.get_submodule("module")

    def model_state_dict(self, part: nn.Module) -> dict[str, Any]:
        """Through the inner module, with uneven-shard metadata (HF names, as every strategy's)."""
        return model_state_dict(part) if is_megatron_fsdp(part) else super().model_state_dict(part)

    def full_tensor(self, t: torch.Tensor, part: nn.Module) -> torch.Tensor:
        if isinstance(t, DTensor) and is_megatron_fsdp(part):
            return megatron_full_tensor(t)
        return super().full_tensor(t, part)

    def describe_wrapper(self, part: nn.Module) -> dict[str, Any]:
        """megatron-fsdp's parameter groups and their buffers (what each rank holds of them)."""
        groups = parameter_buffers(part)
        return {} if groups is None else {"megatron_fsdp": {"parameter_groups": groups}}

    def wrapper_lines(self, part: dict[str, Any], *, rank: int) -> list[str]:
        if "megatron_fsdp" not in part:
            return []
        return [
            f"[rank {rank}] {self.name}: {len(part['megatron_fsdp']['parameter_groups'])} parameter groups"
        ]

    def grad_sync(
        self, parts: list[nn.Module], *, is_last_microbatch: bool, defer: bool
    ) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for part in parts:
            stack.enter_context(microbatch_grad_sync(part, is_last_microbatch=is_last_microbatch))
        return stack

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, part: nn.Module) -> torch.optim.Optimizer:
        return shard_optimizer(optimizer, model=part)

    def clip_grad_norm(
        self,
        params: list[nn.Parameter],
        *,
        max_norm: float | None,
        mesh: MeshContext,
        counted_ids: set[int] | None,
    ) -> torch.Tensor:
        return clip_grad_norm(params, max_norm=max_norm, mesh=mesh)
