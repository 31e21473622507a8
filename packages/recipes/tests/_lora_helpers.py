"""Rank functions for the LoRA tests: train, and report what this rank holds."""

from __future__ import annotations

from typing import Any


def _placements(p: Any) -> dict[str, str] | None:
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return None
    return {axis: str(pl) for axis, pl in zip(p.device_mesh.mesh_dim_names or (), p.placements)}


def lora_train_on_rank(raw: dict[str, Any]) -> dict[str, Any]:
    """Train `raw` (with a ``peft:`` section); return losses, the full gradients of every trainable
    parameter at step 1 (taken at the optimizer step, after clipping), and what this rank holds:
    the placements and ``requires_grad`` of every parameter, and the optimizer's parameter names."""
    import torch
    from torch.distributed.tensor import DTensor

    from automodel.recipes import load_config
    from automodel.recipes.trainer import Trainer

    trainer = Trainer(load_config(raw))
    trainer.build()
    names: dict[int, str] = {}
    params: dict[str, dict[str, Any]] = {}
    for part in trainer.pm.parts:
        for name, p in part.named_parameters():
            name = name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")
            names[id(p)] = name
            params[name] = {"requires_grad": p.requires_grad, "placements": _placements(p)}
    optimizer_params = sorted(
        names[id(p)] for o in trainer.optimizers for g in o.param_groups for p in g["params"]
    )
    grads: dict[str, torch.Tensor] = {}
    grad_placements: dict[str, list[str]] = {}

    def capture(opt: torch.optim.Optimizer, *_: Any) -> None:
        if trainer.step != 0:
            return
        for group in opt.param_groups:
            for p in group["params"]:
                g = p.grad
                if isinstance(g, DTensor):
                    grad_placements[names[id(p)]] = [str(x) for x in g.placements]
                g = g.full_tensor() if isinstance(g, DTensor) else g
                grads[names[id(p)]] = g.detach().cpu().clone()

    for opt in trainer.optimizers:
        opt.register_step_pre_hook(capture)
    result = trainer.train()
    return {
        "losses": result.losses + [result.val_losses[k] for k in sorted(result.val_losses)],
        "grads": grads,
        "grad_placements": grad_placements,
        "params": params,
        "optimizer_params": optimizer_params,
        "num_adapter_params": trainer.lora.num_adapter_params,
    }


def lora_train_then_logits(raw: dict[str, Any], input_ids: Any) -> Any:
    """Train `raw`, then return the trained model's logits for `input_ids` (a layout whose first
    part outputs whole logits: no pipeline)."""
    import torch

    from automodel.recipes import load_config
    from automodel.recipes.trainer import Trainer

    trainer = Trainer(load_config(raw))
    trainer.build()
    trainer.train()
    model = trainer.pm.parts[0]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids.to(trainer.device), use_cache=False).logits
    return logits.detach().cpu()


def lora_initial_adapters_on_rank(raw: dict[str, Any]) -> dict[str, Any]:
    """Build `raw`, gather every adapter weight to full size before the first step (collective),
    then train; returns the adapters, their placements and local shapes on this rank, and the losses."""
    from torch.distributed.tensor import DTensor

    from automodel.recipes import load_config
    from automodel.recipes.trainer import Trainer

    trainer = Trainer(load_config(raw))
    trainer.build()
    adapters, placements, local_shapes = {}, {}, {}
    for part in trainer.pm.parts:
        for name, p in part.named_parameters():
            if ".lora_" in name:
                name = name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")
                placements[name] = _placements(p)
                local_shapes[name] = tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
                full = p.full_tensor() if isinstance(p, DTensor) else p
                adapters[name] = full.detach().cpu().clone()
    result = trainer.train()
    return {
        "adapters": adapters,
        "placements": placements,
        "local_shapes": local_shapes,
        "losses": result.losses,
    }
