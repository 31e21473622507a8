"""The strategy interface: how one data-parallel strategy (FSDP2, DDP, megatron-fsdp) plugs into
the recipes, and `ParallelModel`, what it hands the training loop.

A strategy names its config class (its constructor arguments are the YAML flags of the
``distributed:`` section), its machine-dependent defaults, its rules against the layout sizes, how
it parallelizes and materializes the meta-device model, how the loop syncs gradients, hands it
an optimizer and clips the gradient norm, and what its wrapper means for checkpoints, exports and
kernels (`PartWrapping`, the capability flags). A new strategy is one module subclassing `Strategy`
plus one `register_strategy` call (see `registry.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from automodel.fsdp2 import grad_sync_context
from automodel.mesh import MeshContext, ResolvedLayout, StrategyConfig
from automodel.recipes.grad_norm import clip_grad_norm
from automodel.recipes.parallelisms import mesh_roles, parallelisms, role_group
from automodel.recipes.planning.step import StrategyMemory

if TYPE_CHECKING:
    from automodel.recipes.config.distributed import DistributedSection
    from automodel.recipes.parallelisms import Parallelism

#: A strategy's config class (its constructor arguments are the YAML flags).
C = TypeVar("C", bound=StrategyConfig)

#: Materialize (seeded init, then pretrained weights) the given parts in place.
Initialize = Callable[[list[nn.Module]], None]


@dataclass
class ParallelModel:
    """The model parts this rank holds, and the pieces the loop needs to drive them."""

    parts: list[nn.Module]
    strategy: Strategy
    #: What each parallelism resolved when it was applied, by its name (`parallelisms.base.Resolved`:
    #: cp's attention backend, pp's built pipeline); only that parallelism reads its entry.
    resolved: dict[str, object] = field(default_factory=dict)
    defer_grad_sync: bool = True

    def grad_sync(self, *, is_last_microbatch: bool) -> contextlib.AbstractContextManager:
        """Reduce data-parallel gradients only on the last micro-batch of a step (when deferring)."""
        return self.strategy.grad_sync(
            self.parts, is_last_microbatch=is_last_microbatch, defer=self.defer_grad_sync
        )

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, part: nn.Module) -> torch.optim.Optimizer:
        """Hand an optimizer built on ``part.parameters()`` to the strategy (megatron-fsdp drives its step)."""
        return self.strategy.prepare_optimizer(optimizer, part)

    def norm_parameter_ids(self) -> set[int] | None:
        """The parameters the gradient norm counts (`Parallelism.norm_parameter_ids`: pp counts one
        copy of each tied weight); None: every one."""
        for parallelism in parallelisms():
            ids = parallelism.norm_parameter_ids(self)
            if ids is not None:
                return ids
        return None


class PartWrapping:
    """What a strategy's wrapper around a model part means for the code that reads the part:
    checkpoints, exports, the loss. The defaults are torch's own (FSDP2, plain modules); a strategy
    whose wrapper hides the user's module or its state overrides them, and nothing outside
    `strategies/` knows which wrapper it is."""

    def unwrap(self, part: nn.Module) -> nn.Module:
        """The user's module inside `part` (whose attributes the loss reads); `part` by default."""
        return part

    def state_module(self, part: nn.Module) -> nn.Module:
        """The module whose ``named_parameters`` carry the HF names and the optimizer's parameters
        (what torch's optimizer-state functions take); `part` by default."""
        return part

    def model_state_dict(self, part: nn.Module) -> dict[str, Any]:
        """HF FQN -> (sharded) tensor of `part`, ready for DCP (default: torch's `get_model_state_dict`,
        which strips DDP's and FSDP2's wrapper names)."""
        return get_model_state_dict(part)

    def full_tensor(self, t: torch.Tensor, part: nn.Module) -> torch.Tensor:
        """The whole of `t`, a value of `model_state_dict(part)` (a collective over the ranks that
        share it)."""
        return t.full_tensor() if isinstance(t, DTensor) else t

    def describe_wrapper(self, part: nn.Module) -> dict[str, Any]:
        """What the wrapper around `part` holds beyond its parameters, for the layout report
        (`layout_report.describe_part`); nothing by default."""
        return {}

    def wrapper_lines(self, part: dict[str, Any], *, rank: int) -> list[str]:
        """The layout report's lines about the wrapper, from one part's report; none by default."""
        return []


#: The parts of a model no strategy wrapped (materialization, tests): torch's own state functions.
PLAIN_PARTS = PartWrapping()


class Strategy(PartWrapping, ABC, Generic[C]):
    """One data-parallel strategy over its config class `C`; subclasses set `name` and implement
    `config_class` and `parallelize`."""

    #: The ``distributed.strategy`` value that selects it.
    name: ClassVar[str]
    #: The parallelisms it composes, by name (`automodel.recipes.parallelisms`): an allow-list, so
    #: a parallelism registered later is refused (`axis_refusal`) until a strategy lists it.
    supported_axes: ClassVar[tuple[str, ...]] = ("dp_shard",)
    #: Flags whose default depends on the machine (see `machine_defaults`).
    machine_keys: ClassVar[tuple[str, ...]] = ("backend",)
    #: Flags it applies to each decoder layer (`rules.py` refuses them on a model without a layer list).
    layer_flags: ClassVar[tuple[str, ...]] = ()
    #: The strategy a world of one gets when the YAML names no strategy and the default would change
    #: nothing there (`needed_alone`); at most one registered strategy sets it.
    for_world_of_one: ClassVar[bool] = False
    #: Whether `recipes plan` may write it into the YAML it proposes (its memory model is the
    #: planner's); a subclass inherits it and may list more parallelisms (`planned_strategy`).
    planned: ClassVar[bool] = False
    #: Whether the loss may read the LM head's weight outside the model's forward (the chunked
    #: linear cross-entropy, `output_head`); False keeps full logits.
    head_weight_readable: ClassVar[bool] = True
    #: Whether float8 linears (``fp8.enabled``) compose with its wrapper.
    float8_linears: ClassVar[bool] = True
    #: Whether its wrapper all-gathers float8 weights (``fp8.enable_fsdp_float8_all_gather``).
    float8_all_gather: ClassVar[bool] = False

    @abstractmethod
    def config_class(self) -> type[C]:
        """The strategy package's config dataclass (imported lazily: the package may be optional)."""

    def machine_defaults(self, options: dict[str, Any], *, cuda: bool) -> dict[str, Any]:
        """`options` with the defaults that depend on the machine filled in (default: the process
        group backend, nccl with CUDA, else gloo)."""
        return {**options, "backend": options.get("backend", "nccl" if cuda else "gloo")}

    def with_machine_defaults(self, config: C, *, keys: frozenset[str], cuda: bool) -> C:
        """`config` with the flags `keys` set to this machine's defaults (`machine_defaults`)."""
        values = self.machine_defaults({}, cuda=cuda)
        return dataclasses.replace(config, **{k: values[k] for k in keys})

    def check_environment(self, config: C) -> None:
        """`ConfigError` naming the ``distributed.<key>`` this machine cannot run, the strategy or
        one of its flags `config` (called before any rank starts; `recipes validate` reports it as a
        line); none by default."""
        return None

    def axis_refusal(self, parallelism: Parallelism) -> str:
        """Why the YAML may not ask for `parallelism` (not in `supported_axes`): the message of the
        `ConfigError` naming its ``distributed.<size key>``."""
        supported = ", ".join(self.supported_axes) or "none"
        return f"is not supported by strategy {self.name} (must be {parallelism.unused}; it supports {supported})"

    def check_sizes(self, sizes: dict[str, int | None], options: dict[str, Any], config: C) -> None:
        """Rules across this strategy and the layout sizes (`ConfigError` naming the key); none by default."""
        return None

    def check_parallelism_config(self, config: object, *, options: Mapping[str, object]) -> None:
        """Refuse an option of a parallelism's typed config (`Parallelism.build_config`, from
        `options`) that this strategy cannot honour, as a `ConfigError` naming the key (megatron_fsdp,
        which applies TP inside its own wrapper: sequence parallelism); none by default."""
        return None

    def check_layout(self, layout: ResolvedLayout) -> None:
        """Rules across this strategy and the resolved layout (the world size known); none by default."""
        return None

    def needed_alone(self, config: C, *, param_dtype: torch.dtype) -> bool:
        """Whether a world of one needs this strategy with `config` and parameters of `param_dtype`
        (False: it would shard and reduce nothing and change no numerics); True by default."""
        return True

    @abstractmethod
    def memory_model(self, config: C) -> StrategyMemory:
        """What it keeps per rank and moves, for `config` (the memory planner's terms, `planning.memory`)."""

    @abstractmethod
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
        """Apply the layout to the meta-device `model`, materialize it with `initialize`, and return the parts."""

    def grad_sync(
        self, parts: list[nn.Module], *, is_last_microbatch: bool, defer: bool
    ) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's backward: skip the gradient reduction unless it is the last
        (when `defer`). Default: automodel.fsdp2's `grad_sync_context` (FSDP2 and DDP)."""
        stack = contextlib.ExitStack()
        for part in parts:
            stack.enter_context(grad_sync_context(part, is_last_microbatch=is_last_microbatch, enabled=defer))
        return stack

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, part: nn.Module) -> torch.optim.Optimizer:
        """The optimizer the loop steps for `part` (default: `optimizer` itself)."""
        return optimizer

    def clip_grad_norm(
        self,
        params: list[nn.Parameter],
        *,
        max_norm: float | None,
        mesh: MeshContext,
        counted_ids: set[int] | None,
    ) -> torch.Tensor:
        """The global gradient norm before clipping to `max_norm`; only `counted_ids` count when
        given (`ParallelModel.norm_parameter_ids`: one copy of each tied weight under PP)."""
        # the ranks holding different plain parameters (the pipeline's stages: `mesh_roles`)
        norm_group = role_group(mesh, mesh_roles().norm_axes)
        return clip_grad_norm(params, max_norm=max_norm, norm_group=norm_group, counted_ids=counted_ids)
