"""FSDP2 / HSDP sharding: one unit per decoder layer, the root last."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from automodel.mesh import MeshContext
from automodel.mesh.reduction import reduce_unused_parameters, set_unit_gradient_divide_factor


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
) -> FSDPModule:
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
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
            )


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
) -> list[FSDPModule]:
    """Shard every element of every ModuleList as its own FSDP2 unit, then the root; returns the units.

    `mesh` is a MeshContext (FSDP over ``dp_shard_cp``, HSDP over ``dp_replicate x dp_shard_cp``
    when ``dp_replicate > 1``) or an explicit DeviceMesh. ``reshard_after_forward=None`` keeps the
    heuristic: all layers but the last reshard, none under PP; the root never does.
    ``gradient_divide_factor=1.0`` makes the gradient reduction a pure sum. ``mp_policy=None`` is
    torch's default (no casting); offload with ``CPUOffloadPolicy(pin_memory=False)`` on CPU.
    """
    if gradient_divide_factor is not None and gradient_divide_factor <= 0:
        raise ValueError(f"gradient_divide_factor must be > 0 or None, got {gradient_divide_factor}")
    fsdp_mesh = get_fsdp_mesh(mesh) if isinstance(mesh, MeshContext) else mesh
    units: list[FSDPModule] = []
    _shard_children(
        model,
        mesh=fsdp_mesh,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        pp_enabled=pp_enabled,
        reshard_after_forward=reshard_after_forward,
        units=units,
    )
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
    if gradient_divide_factor is not None:
        set_gradient_divide_factor(model, factor=gradient_divide_factor)
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
