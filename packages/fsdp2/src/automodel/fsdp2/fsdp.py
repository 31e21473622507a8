"""FSDP2 / HSDP sharding: one unit per decoder layer, the root last; submodules named by the caller
(expert-parallel experts, a head in its own precision) become units of their own first, over their
own mesh (torchtitan's ``apply_fsdp`` with ``ep_degree``: experts over the ranks that hold the same
experts, the rest over ``dp_shard_cp``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Shard

from automodel.mesh import MeshContext
from automodel.mesh.reduction import reduce_unused_parameters, set_unit_gradient_divide_factor


@dataclass(frozen=True)
class SubmoduleSharding:
    """One submodule sharded as its own FSDP2 unit, before the decoder layer that holds it.

    mesh: None shards over the model's FSDP mesh. Expert-parallel experts pass the ranks holding
        the same experts (``ep_shard``): their parameters are already DTensors over ``ep``.
    shard_placement_fn: FSDP's per-parameter dim (torch's ``shard_placement_fn``; None: dim 0).
    gradient_divide_factor: this unit's divisor of reduced gradients; None takes the model's
        ``gradient_divide_factor``, else torch's default (the size of `mesh`). Experts pass the
        dense data-parallel size: the all-to-all backward already summed their ep group's share.
    mp_policy: None takes the model's policy (a head computing in fp32 passes its own).
    reshard_after_forward: None follows the layer holding the unit (the root's choice outside layers).
    """

    module: nn.Module
    mesh: DeviceMesh | None = None
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None
    gradient_divide_factor: float | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    reshard_after_forward: bool | None = None


def get_fsdp_mesh(mesh: MeshContext) -> DeviceMesh:
    """The mesh parameters are sharded over: ``dp_shard_cp``, or ``(dp_replicate, dp_shard_cp)`` for HSDP."""
    if mesh.layout.dp_replicate > 1:
        return mesh.device_mesh[("dp_replicate", "dp_shard_cp")]
    return mesh.get_mesh("dp_shard_cp")


def _fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    reshard_after_forward: bool,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
) -> FSDPModule:
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    if shard_placement_fn is not None:
        kwargs["shard_placement_fn"] = shard_placement_fn
    unit = fully_shard(module, **kwargs)
    reduce_unused_parameters(unit)
    return unit


def _shard_children(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    pp_enabled: bool,
    reshard_after_forward: bool | None,
    units: list[FSDPModule],
    submodules: list[SubmoduleSharding],
) -> None:
    for child in module.children():
        if isinstance(child, nn.ModuleList):
            layers = [m for m in child if m is not None]
            for group in _groups_sharing_parameters(layers):
                # The last layer's parameters are needed again at once by backward; under PP each
                # micro-batch would re-gather, so nothing is resharded there.
                reshard = reshard_after_forward
                if reshard is None:
                    reshard = not pp_enabled and layers.index(group[-1]) < len(layers) - 1
                _shard_submodules_within(
                    group,
                    submodules=submodules,
                    mesh=mesh,
                    mp_policy=mp_policy,
                    offload_policy=offload_policy,
                    reshard_after_forward=reshard,
                    units=units,
                )
                units.append(
                    _fully_shard(
                        group[0] if len(group) == 1 else group,
                        mesh=mesh,
                        mp_policy=mp_policy,
                        offload_policy=offload_policy,
                        reshard_after_forward=reshard,
                    )
                )
        elif not isinstance(child, FSDPModule):
            _shard_children(
                child,
                mesh=mesh,
                mp_policy=mp_policy,
                offload_policy=offload_policy,
                pp_enabled=pp_enabled,
                reshard_after_forward=reshard_after_forward,
                units=units,
                submodules=submodules,
            )


def _shard_submodules_within(
    roots: Sequence[nn.Module],
    *,
    submodules: list[SubmoduleSharding],
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    reshard_after_forward: bool,
    units: list[FSDPModule],
) -> None:
    """Shard each requested submodule inside `roots` as its own unit and drop it from `submodules`
    (it must become a unit before the unit that holds it)."""
    inside = {id(m) for root in roots for m in root.modules()}
    for spec in [s for s in submodules if id(s.module) in inside]:
        submodules.remove(spec)
        units.append(
            _fully_shard(
                spec.module,
                mesh=mesh if spec.mesh is None else spec.mesh,
                mp_policy=mp_policy if spec.mp_policy is None else spec.mp_policy,
                offload_policy=offload_policy,
                reshard_after_forward=(
                    reshard_after_forward
                    if spec.reshard_after_forward is None
                    else spec.reshard_after_forward
                ),
                shard_placement_fn=spec.shard_placement_fn,
            )
        )


def offload_policy_refusal(policy: OffloadPolicy | None) -> str | None:
    """Why torch would refuse `policy` on this machine (None: it would not): it pins offloaded
    parameters through the CUDA driver, so ``CPUOffloadPolicy(pin_memory=True)`` fails without one.
    A callee of both `check_offload_policy` and the recipes' pre-launch check (one message)."""
    if isinstance(policy, CPUOffloadPolicy) and policy.pin_memory and not torch.cuda.is_available():
        return (
            "needs CUDA: torch pins the offloaded parameters through the CUDA driver and fails "
            "without one ('Found no NVIDIA driver'); pass pin_memory=False on this machine"
        )
    return None


def check_offload_policy(policy: OffloadPolicy | None) -> None:
    """Refuse what torch refuses on this machine, saying why (dense or MoE), before it fails."""
    reason = offload_policy_refusal(policy)
    if reason is not None:
        raise ValueError(f"offload_policy: CPUOffloadPolicy(pin_memory=True) {reason}")


def _groups_sharing_parameters(layers: list[nn.Module]) -> list[list[nn.Module]]:
    """`layers` in order, grouped so that layers holding the same parameter object share one FSDP
    unit (a parameter can belong to one unit only: Zamba ties one attention block into several
    layers); a group sits at its first layer's place."""
    owner: dict[int, int] = {}  # parameter id -> index of the group holding it
    groups: list[list[nn.Module]] = []
    for layer in layers:
        ids = [id(p) for p in layer.parameters()]
        hit = sorted({owner[i] for i in ids if i in owner})
        if not hit:
            groups.append([layer])
            target = len(groups) - 1
        else:
            target = hit[0]
            for other in hit[1:]:  # this layer joins groups that were separate so far
                groups[target] += groups[other]
                groups[other] = []
                owner.update({i: target for i, g in owner.items() if g == other})
            groups[target].append(layer)
        owner.update({i: target for i in ids})
    return [g for g in groups if g]


def apply_fsdp2_sharding_recursively(
    model: nn.Module,
    *,
    mesh: MeshContext | DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    pp_enabled: bool = False,
    gradient_divide_factor: float | None = None,
    reshard_after_forward: bool | None = None,
    wrap_root: bool = True,
    submodules: Sequence[SubmoduleSharding] = (),
) -> list[FSDPModule]:
    """Shard every element of every ModuleList as its own FSDP2 unit, then the root; returns the units.

    `mesh` is a MeshContext (FSDP over ``dp_shard_cp``, HSDP over ``dp_replicate x dp_shard_cp``
    when ``dp_replicate > 1``) or an explicit DeviceMesh. ``reshard_after_forward=None`` keeps the
    heuristic: all layers but the last reshard, none under PP; the root never does.
    ``gradient_divide_factor=1.0`` makes the gradient reduction a pure sum. ``wrap_root=False``:
    no root unit; each module still owning parameters outside the units becomes its own. ``mp_policy=None`` is
    torch's default (no casting); offload with ``CPUOffloadPolicy(pin_memory=False)`` on CPU.
    `submodules` become units of their own (their mesh, placement, divisor, policy) ahead of the
    layer holding them, or ahead of the root when no layer does.
    """
    if gradient_divide_factor is not None and gradient_divide_factor <= 0:
        raise ValueError(f"gradient_divide_factor must be > 0 or None, got {gradient_divide_factor}")
    check_offload_policy(offload_policy)
    fsdp_mesh = get_fsdp_mesh(mesh) if isinstance(mesh, MeshContext) else mesh
    for spec in submodules:
        factor = spec.gradient_divide_factor
        if factor is not None and not factor > 0:
            raise ValueError(f"a submodule's gradient_divide_factor must be > 0 or None, got {factor}")
    units: list[FSDPModule] = []
    pending = list(submodules)
    _shard_children(
        model,
        mesh=fsdp_mesh,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        pp_enabled=pp_enabled,
        reshard_after_forward=reshard_after_forward,
        units=units,
        submodules=pending,
    )
    _shard_submodules_within(
        [model],
        submodules=pending,
        mesh=fsdp_mesh,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=bool(reshard_after_forward),
        units=units,
    )
    if pending:
        raise ValueError(f"{len(pending)} submodule(s) to shard are not part of {type(model).__name__}")
    if wrap_root and not isinstance(model, FSDPModule):
        units.append(
            _fully_shard(
                model,
                mesh=fsdp_mesh,
                mp_policy=mp_policy,
                offload_policy=offload_policy,
                reshard_after_forward=False,
            )
        )
    elif not wrap_root:
        # No root unit: every module still owning parameters outside the units becomes one itself
        # (else embeddings and the final norm would be neither sharded nor reduced).
        managed = {id(p) for unit in units for p in unit.parameters()}  # pyright: ignore[reportAttributeAccessIssue]
        for module in list(model.modules()):
            own = [p for p in module.parameters(recurse=False) if id(p) not in managed]
            if own and not isinstance(module, FSDPModule):
                units.append(
                    _fully_shard(
                        module,
                        mesh=fsdp_mesh,
                        mp_policy=mp_policy,
                        offload_policy=offload_policy,
                        reshard_after_forward=bool(reshard_after_forward),
                    )
                )
                managed.update(id(p) for p in module.parameters())
    if gradient_divide_factor is not None:
        set_gradient_divide_factor(model, factor=gradient_divide_factor)
    for spec in submodules:
        if spec.gradient_divide_factor is not None:
            assert isinstance(spec.module, FSDPModule)
            set_unit_gradient_divide_factor(spec.module, factor=spec.gradient_divide_factor)
    return units


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """Every FSDPModule in `model` (root included), in module order."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def set_gradient_divide_factor(model: nn.Module, *, factor: float) -> None:
    """Divide reduced gradients by `factor` instead of the data-parallel size (1.0 = sum)."""
    for unit in fsdp_units(model):
        set_unit_gradient_divide_factor(unit, factor=factor)


@contextmanager
def unshard_fsdp2_model(model: nn.Module) -> Iterator[None]:
    """Gather every FSDP2 unit's full parameters for the block, reshard after (e.g. for logprobs)."""
    units = fsdp_units(model)
    try:
        for unit in units:
            unit.unshard()
        yield
    finally:
        for unit in units:
            unit.reshard()
