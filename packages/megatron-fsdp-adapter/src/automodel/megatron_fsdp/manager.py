"""`MegatronFSDPManager`: strategy megatron_fsdp = TP -> MLP activation checkpointing -> megatron-fsdp."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from automodel.fsdp2 import TensorParallelConfig, apply_tp
from automodel.megatron_fsdp.checkpointing import apply_mlp_checkpointing
from automodel.megatron_fsdp.config import MegatronFSDPConfig, check_tensor_parallel
from automodel.megatron_fsdp.fully_shard import apply_megatron_fsdp
from automodel.megatron_fsdp.layout import MegatronFSDPAxes, check_layout, megatron_fsdp_axes
from automodel.megatron_fsdp.runtime import import_megatron_fsdp
from automodel.megatron_fsdp.translate import build_fully_shard_call
from automodel.megatron_fsdp.units import resolve_unit_modules
from automodel.mesh import MeshContext


class MegatronFSDPManager:
    """Applies `config` to models on the layout `mesh`; checks the layout when constructed.

    The order is fixed: TP over ``tp`` (DTensor plan: ``config`` ``tp_plan``, else the model's HF
    plan, else the Llama default), then checkpointing of each unit's MLP, then megatron-fsdp over
    ``dp`` (``dp_cp`` when cp > 1), at every dp size. Only the first two steps run without CUDA
    (`apply_tp_and_checkpointing`). A composer that owns the TP options apart from the strategy's
    flags passes them as `tensor_parallel` (checked by `check_tensor_parallel`); they replace
    ``config``'s ``tp_plan``.
    """

    def __init__(
        self,
        config: MegatronFSDPConfig,
        mesh: MeshContext,
        *,
        gradient_divide_factor: float | None = None,
        tensor_parallel: TensorParallelConfig | None = None,
    ) -> None:
        if not isinstance(config, MegatronFSDPConfig):
            raise ValueError(f"config must be a MegatronFSDPConfig, got {type(config).__name__}")
        check_layout(mesh)
        if tensor_parallel is not None:
            check_tensor_parallel(tensor_parallel)
        self.tp_plan = config.custom_tp_plan if tensor_parallel is None else tensor_parallel.tp_plan
        self.config = config
        self.mesh = mesh
        self.gradient_divide_factor = gradient_divide_factor
        self._check_divide_factor(gradient_divide_factor)

    def _check_divide_factor(self, factor: float | None) -> None:
        """Raise the translation's ValueError now rather than after TP has run."""
        axes = self.axes
        build_fully_shard_call(
            self.config,
            dp_shard_dim=axes.dp_shard_dim,
            tp_dim=axes.tp_dim,
            unit_modules=[],
            dp_group_size=axes.dp_group_size,
            gradient_divide_factor=factor,
        )

    @property
    def axes(self) -> MegatronFSDPAxes:
        """The mesh axes megatron-fsdp shards over (and their group size)."""
        return megatron_fsdp_axes(self.mesh)

    def apply_tp_and_checkpointing(self, model: nn.Module) -> list[type[nn.Module]]:
        """The steps before megatron-fsdp: TP over ``tp``, then MLP checkpointing; returns the unit classes.

        Runs anywhere (CPU too) and on meta-device models, so the caller can materialize or load
        weights into the TP-sharded parameters before `wrap` hands them to megatron-fsdp.
        """
        units = resolve_unit_modules(model, self.config.megatron_fsdp_unit_modules)
        if self.mesh.layout.tp_enabled:
            apply_tp(
                model,
                tp_mesh=self.mesh.get_mesh("tp"),
                tp_plan=self.tp_plan,
                sequence_parallel=False,
            )
        if self.config.activation_checkpointing:
            apply_mlp_checkpointing(model, unit_modules=units)
        return units

    def parallelize(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        gradient_divide_factor: float | None = None,
        materialize: Callable[[nn.Module], None] | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """TP -> MLP checkpointing -> `materialize` (if given) -> megatron-fsdp; returns ``(model, optimizer)``.

        megatron-fsdp wraps the model at every dp size (dp = 1 included: its parameter buffers,
        mixed precision and optimizer hand-over are the strategy), so CUDA is required; without
        it `MegatronFSDPUnavailableError` is raised before the model is touched.
        `gradient_divide_factor` (default: the manager's): None averages over the dp group, 1.0
        sums (see `build_fully_shard_call`). The model comes back as a ``MegatronFSDP`` wrapper
        (the original module is its ``.module``); `optimizer`, if given, now steps its parameters.
        """
        if gradient_divide_factor is None:
            gradient_divide_factor = self.gradient_divide_factor
        self._check_divide_factor(gradient_divide_factor)
        import_megatron_fsdp()  # fail before TP touches the model when megatron-fsdp cannot run
        param_names = {id(p): name for name, p in model.named_parameters()}
        units = self.apply_tp_and_checkpointing(model)
        if materialize is not None:
            materialize(model)
        return apply_megatron_fsdp(
            model,
            mesh=self.mesh,
            config=self.config,
            unit_modules=units,
            optimizer=optimizer,
            gradient_divide_factor=gradient_divide_factor,
            optimizer_param_names=param_names,
        )
