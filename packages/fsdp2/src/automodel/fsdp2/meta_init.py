"""Meta-device path: build on ``meta``, shard, then materialize only this rank's shards.

Every parameter is generated in full on CPU from a generator seeded by (seed, FQN) and this
rank keeps its shard, so the values do not depend on the layout: the same call on the unsharded
model in one process gives bit-identical parameters. Peak extra memory is one full parameter.
Buffers the model computes (rotary frequencies, embedding scales, router correction biases) are
recomputed by the model's own ``_init_weights``, else by re-creating their module from its config.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from automodel.mesh.model_parts import canonical_fqn, model_text_config

#: ``init_fn(fqn, full_tensor, generator)`` fills `full_tensor` (CPU, full shape) in place.
InitFn = Callable[[str, torch.Tensor, torch.Generator], None]


def default_init_fn(std: float = 0.02) -> InitFn:
    """HF-style init: matrices ~ N(0, std), biases 0, 1-D weights (norms) 1."""

    def init(fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if fqn.endswith("bias"):
            tensor.zero_()
        elif tensor.ndim == 1:
            tensor.fill_(1.0)
        else:
            tensor.normal_(mean=0.0, std=std, generator=generator)

    return init


def _seed_for(seed: int, fqn: str) -> int:
    return zlib.crc32(f"{seed}:{fqn}".encode())


def _meta_buffers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [
        (module, name)
        for module in model.modules()
        for name, buf in module.named_buffers(recurse=False)
        if buf is not None and buf.is_meta
    ]


def _init_weights_owner(model: nn.Module) -> nn.Module | None:
    """The outermost module with a Hugging Face ``_init_weights`` (the model's own init code)."""
    for module in model.modules():
        if callable(getattr(module, "_init_weights", None)) and hasattr(module, "config"):
            return module
    return None


def _restore_with_init_weights(owner: nn.Module | None, module: nn.Module, names: list[str]) -> str | None:
    """Let the model's own ``_init_weights`` fill `module`'s lost buffers; its parameters are kept.

    The parameters of `module` and of every submodule are swapped for meta placeholders during the
    call: the model's init would otherwise overwrite the seeded values, also those of submodules
    (LongCat-Flash's router re-draws its child ``classifier.weight`` from the global RNG, which
    differs between one process and the ranks, and between plain and sharded tensors). Float
    buffers are poisoned with NaN first, so a buffer the init code does not set is detected.
    Returns None when every buffer was filled, else why not.
    """
    if owner is None:
        return "the model has no _init_weights"
    if not all(module.get_buffer(n).is_floating_point() for n in names):
        return "a lost buffer is not floating point"
    for name in names:
        module.get_buffer(name).fill_(float("nan"))
    kept = [
        (holder, name, param)
        for holder in module.modules()
        for name, param in holder.named_parameters(recurse=False, remove_duplicate=False)
    ]
    for holder, name, param in kept:
        placeholder = torch.empty(param.shape, dtype=param.dtype, device="meta")
        setattr(holder, name, nn.Parameter(placeholder, requires_grad=param.requires_grad))
    failure = None
    try:
        owner._init_weights(module)  # pyright: ignore[reportCallIssue]  # HF method; Module.__getattr__ is typed Tensor | Module
    except Exception as err:  # noqa: BLE001 - reported if re-creating the module fails too
        failure = f"{type(owner).__name__}._init_weights failed: {type(err).__name__}: {err}"
    finally:
        for holder, name, param in kept:
            setattr(holder, name, param)
    if failure is None and any(torch.isnan(module.get_buffer(n)).any() for n in names):
        failure = f"{type(owner).__name__}._init_weights does not set them"
    return failure


def _plain_class(module: nn.Module) -> type:
    """The module's own class (FSDP2 swaps in a subclass named ``FSDP<name>``)."""
    cls = type(module)
    if cls.__name__.startswith("FSDP"):
        cls = next((c for c in cls.__mro__ if c.__name__ == cls.__name__[4:]), cls)
    return cls


def _recreate(module: nn.Module, config: object, layer_idx: int | None) -> nn.Module | None:
    """`module`'s class built afresh on CPU from `config` (the usual HF constructor shapes), or None."""
    cls = _plain_class(module)
    calls = [lambda: cls(config=config), lambda: cls(config)]
    if layer_idx is not None:
        calls += [lambda: cls(config, layer_idx), lambda: cls(config=config, layer_idx=layer_idx)]
    with torch.device("cpu"):
        for call in calls:
            try:
                return call()
            except (TypeError, ValueError, AttributeError, IndexError):
                continue
    return None


def _rebuild_buffers(
    module: nn.Module, names: list[str], device: torch.device, *, why: str, root: nn.Module, fqn: str
) -> None:
    """Recompute buffers lost on meta (rotary ``inv_freq``, an activation's constants) by re-creating,
    on CPU, the module or else its nearest ancestor that can be built from the model's config, and
    copying the buffers from the fresh copy (the module's own construction code computes them)."""
    root_config = getattr(root, "config", None)
    text_config = model_text_config(root)
    atoms = fqn.split(".") if fqn else []
    for depth in range(len(atoms), -1, -1):
        owner = root.get_submodule(".".join(atoms[:depth]))
        layer_idx = next((int(a) for a in reversed(atoms[:depth]) if a.isdigit()), None)
        fresh = None
        for config in {
            id(c): c for c in (getattr(owner, "config", None), text_config, root_config) if c is not None
        }.values():
            fresh = _recreate(owner, config, layer_idx)
            if fresh is not None:
                break
        if fresh is None:
            continue
        try:
            twin = fresh.get_submodule(canonical_fqn(".".join(atoms[depth:])))
        except AttributeError:
            continue
        fresh_buffers = dict(twin.named_buffers(recurse=False))
        if all(n in fresh_buffers for n in names):
            for name in names:
                setattr(
                    module, name, fresh_buffers[name].to(device)
                )  # a buffer stays one (and keeps persistence)
            return
    raise ValueError(
        f"cannot recompute buffers {names} of {type(module).__name__} at {fqn or '<root>'} after meta init "
        f"({why}, and neither it nor an enclosing module can be re-created from the config); build that "
        "module off the meta device"
    )


@torch.no_grad()
def materialize_meta_model(
    model: nn.Module,
    *,
    device: torch.device | str,
    seed: int = 0,
    init_fn: InitFn | None = None,
) -> nn.Module:
    """Allocate (``to_empty``) and initialize `model`'s parameters and lost buffers on `device`.

    Run after TP/FSDP2 sharding: each rank allocates only its shards. Works unchanged on an
    unsharded or already-materialized model (the values are the same). `init_fn` defaults to
    `default_init_fn` with the config's ``initializer_range``.
    """
    device = torch.device(device)
    if init_fn is None:
        config = getattr(model, "config", None)
        init_fn = default_init_fn(float(getattr(config, "initializer_range", 0.02) or 0.02))
    lost = _meta_buffers(model)
    if any(t.is_meta for t in model.parameters()) or lost:
        model.to_empty(device=device)
    for fqn, param in model.named_parameters():
        name = canonical_fqn(fqn)
        full = torch.empty(param.shape, dtype=param.dtype, device="cpu")
        init_fn(name, full, torch.Generator().manual_seed(_seed_for(seed, name)))
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            replicated = DTensor.from_local(full.to(device), mesh, [Replicate()] * mesh.ndim, run_check=False)
            local = replicated.redistribute(mesh, param.placements).to_local()
            target = param.to_local()
            assert target.shape == local.shape, (fqn, target.shape, local.shape)
            target.copy_(local)
        else:
            param.copy_(full)
    by_module: dict[int, tuple[nn.Module, list[str]]] = {}
    for module, name in lost:
        by_module.setdefault(id(module), (module, []))[1].append(name)
    owner = _init_weights_owner(model) if by_module else None
    fqns = {id(m): n for n, m in model.named_modules(remove_duplicate=False)} if by_module else {}
    for module, names in by_module.values():
        why = _restore_with_init_weights(owner, module, names)
        if why is not None:
            _rebuild_buffers(module, names, device, why=why, root=model, fqn=fqns[id(module)])
    return model


def local_numel_fraction(model: nn.Module) -> float:
    """This rank's share of the parameter elements (1.0 unsharded), e.g. to check FSDP memory."""
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    full = sum(math.prod(p.shape) for p in model.parameters())
    return local / full
