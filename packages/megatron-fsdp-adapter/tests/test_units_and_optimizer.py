"""Unit-module resolution, MLP activation checkpointing and the optimizer hand-over (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from automodel.megatron_fsdp import (
    apply_mlp_checkpointing,
    neutral_state_init,
    rebind_param_groups,
    resolve_unit_modules,
)
from automodel.testing.tiny_model import tiny_llama


def test_units_default_to_no_split_modules() -> None:
    assert resolve_unit_modules(tiny_llama()) == [LlamaDecoderLayer]


def test_units_by_class_name_and_import_path() -> None:
    model = tiny_llama()
    assert resolve_unit_modules(model, ["LlamaDecoderLayer", "LlamaRMSNorm"]) == [
        LlamaDecoderLayer,
        LlamaRMSNorm,
    ]
    path = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    assert resolve_unit_modules(model, [path, "LlamaDecoderLayer"]) == [LlamaDecoderLayer]


@pytest.mark.parametrize(
    "names", [["LlamaBlock"], ["transformers.models.llama.modeling_llama.NoSuchLayer"], ["torch.zeros"]]
)
def test_unknown_unit_is_a_value_error(names: list[str]) -> None:
    with pytest.raises(ValueError, match="megatron_fsdp_unit_modules") as info:
        resolve_unit_modules(tiny_llama(), names)
    assert names[0] in str(info.value)


def test_model_without_no_split_modules_needs_explicit_units() -> None:
    with pytest.raises(ValueError, match="_no_split_modules"):
        resolve_unit_modules(nn.Sequential(nn.Linear(2, 2)))


def loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()
    }
    return loss.item(), grads


def test_mlp_checkpointing_wraps_each_mlp_and_keeps_loss_and_grads() -> None:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = loss_and_grads(tiny_llama(), ids)
    model = tiny_llama()
    assert apply_mlp_checkpointing(model, unit_modules=[LlamaDecoderLayer]) == 2
    assert all(hasattr(layer.mlp, "_checkpoint_wrapped_module") for layer in model.model.layers)
    assert model.config.use_cache is False
    assert set(model.state_dict()) == set(tiny_llama().state_dict())
    loss, grads = loss_and_grads(model, ids)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_mlp_checkpointing_without_mlp_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="activation_checkpointing"):
        apply_mlp_checkpointing(tiny_llama(), unit_modules=[LlamaRMSNorm])


def eager_init(optimizer: torch.optim.Optimizer) -> None:
    """What megatron_fsdp.fully_shard_optimizer does to create the optimizer state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, weight_decay=0.01),
    ],
)
def test_neutral_state_init_leaves_training_unchanged(make) -> None:
    torch.manual_seed(0)
    fresh, handed = nn.Linear(8, 4), nn.Linear(8, 4)
    handed.load_state_dict(fresh.state_dict())
    opt_fresh, opt_handed = make(fresh.parameters()), make(handed.parameters())
    with neutral_state_init(opt_handed):
        eager_init(opt_handed)
    for p, q in zip(fresh.parameters(), handed.parameters()):
        assert torch.equal(p, q)  # the eager step changed nothing
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for model, opt in ((fresh, opt_fresh), (handed, opt_handed)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        for p, q in zip(fresh.parameters(), handed.parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=0)
    assert [g["lr"] for g in opt_handed.param_groups] == [g["lr"] for g in opt_fresh.param_groups]


def test_rebind_keeps_groups_and_hyperparameters() -> None:
    old = nn.Linear(4, 4)
    new = nn.Linear(4, 4)
    wrapped_names = {"weight": new.weight, "bias": new.bias}
    opt = torch.optim.AdamW(
        [{"params": [old.weight], "weight_decay": 0.1}, {"params": [old.bias], "weight_decay": 0.0}], lr=1e-3
    )
    names = {id(p): n for n, p in old.named_parameters()}
    rebind_param_groups(opt, old_names=names, new_params=wrapped_names)
    assert [g["params"] for g in opt.param_groups] == [[new.weight], [new.bias]]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)
    # megatron-fsdp's fully_shard_optimizer takes a group's first key as its parameter list.
    assert all(next(iter(g)) == "params" for g in opt.param_groups)


def test_rebind_matches_through_checkpoint_wrapper_names() -> None:
    old, new = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD(old.parameters(), lr=0.1)
    names = {id(old.weight): "mlp.weight", id(old.bias): "mlp.bias"}
    new_params = {
        "mlp._checkpoint_wrapped_module.weight": new.weight,
        "mlp._checkpoint_wrapped_module.bias": new.bias,
    }
    rebind_param_groups(opt, old_names=names, new_params=new_params)
    assert opt.param_groups[0]["params"] == [new.weight, new.bias]


def test_rebind_rejects_a_foreign_parameter() -> None:
    model, stranger = nn.Linear(2, 2), nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="param_groups\\[0\\]"):
        rebind_param_groups(opt, old_names=names, new_params=dict(model.named_parameters()))
