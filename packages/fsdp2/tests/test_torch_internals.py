"""Every private torch API the package reaches (automodel/fsdp2/torch_internals.py) is where the
installed torch keeps it: this test fails first, naming the API, when a torch release moves one."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

import automodel.fsdp2
from automodel.fsdp2 import torch_internals as ti
from automodel.fsdp2.activation_checkpointing import apply_activation_checkpointing
from automodel.fsdp2.tp_lora import with_lora_adapters
from automodel.fsdp2.tp_shared_styles import RowwiseOwnedOutput
from automodel.testing.private_torch import private_torch_uses
from automodel.testing.ranks import run_on_ranks

SRC = Path(automodel.fsdp2.__file__).parent

#: private attribute names of torch objects (torch_internals holds the accessors)
PRIVATE_ATTRIBUTES = (
    "_modules",
    "_parameters",
    "_buffers",
    "_micro_pipeline_tp",
    "_partition_linear_fn",
    "_prepare_output_fn",
    ti.CHECKPOINT_WRAPPED,
)


def test_the_installed_torch_release_is_a_checked_one() -> None:
    """A new torch release is added to CHECKED_TORCH only after `nox -s torch_range` passed on it."""
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release in ti.CHECKED_TORCH, (
        f"torch {torch.__version__} is not among the releases automodel.fsdp2 was checked on "
        f"({ti.CHECKED_TORCH}); run `nox -s torch_range` on it and add it to torch_internals.CHECKED_TORCH"
    )


def test_no_other_module_uses_a_private_torch_name() -> None:
    """torch_internals is the one home: no other module imports or reads a private torch name."""
    assert private_torch_uses(SRC, attributes=PRIVATE_ATTRIBUTES) == {}


def test_checkpoint_wrapper_is_where_checked() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
    keys = list(model.state_dict())
    assert apply_activation_checkpointing(model) == 2
    assert all(isinstance(getattr(layer, ti.CHECKPOINT_WRAPPED), nn.Linear) for layer in model.layers)
    assert list(model.state_dict()) == keys
    x = torch.randn(2, 3, requires_grad=True)
    model.layers[1](model.layers[0](x)).sum().backward()
    assert x.grad is not None


def test_async_tp_hooks_are_where_checked() -> None:
    inductor_config, enable = ti._async_tp_hooks()
    assert isinstance(inductor_config._micro_pipeline_tp, bool)
    assert list(inspect.signature(enable).parameters) == ["group_name"]


def test_tp_style_hooks_have_the_checked_signatures() -> None:
    """The private hooks tp_shared_styles and tp_lora override or call keep their parameters."""
    assert getattr(ParallelStyle._apply, "__isabstractmethod__", False)
    assert list(inspect.signature(ParallelStyle._apply).parameters) == ["self", "module", "device_mesh"]
    hook = inspect.getattr_static(RowwiseParallel, "_prepare_output_fn")
    assert isinstance(hook, staticmethod)
    assert list(inspect.signature(hook).parameters) == [
        "output_layouts", "use_local_output", "mod", "outputs", "device_mesh",
    ]  # fmt: skip
    for style in (ColwiseParallel, RowwiseParallel):
        params = list(inspect.signature(style._partition_linear_fn).parameters)
        assert params == ["self", "name", "module", "device_mesh"], style


class _LoRALinear(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 6)
        self.lora_A, self.lora_B = nn.Linear(4, 2, bias=False), nn.Linear(2, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_B(self.lora_A(x))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = _LoRALinear(), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def _tp_styles_on_two_ranks() -> dict:
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(3, 4)
    want = block(x)
    plan = with_lora_adapters(block, {"up": ColwiseParallel(), "down": RowwiseOwnedOutput()})
    parallelize_module(block, init_device_mesh("cpu", (2,)), plan)
    got = block(x)
    got.add_(0)  # the owned local output may be updated in place
    return {
        "rank": dist.get_rank(),
        "close": torch.allclose(got, want, atol=1e-6),
        "placements": {n: str(p.placements) for n, p in block.named_parameters()},  # pyright: ignore[reportAttributeAccessIssue]
    }


def test_tp_style_hooks_shard_as_checked() -> None:
    for result in run_on_ranks(_tp_styles_on_two_ranks, world_size=2):
        assert result["close"], result["rank"]
        assert result["placements"]["up.weight"] == "(Shard(dim=0),)"
        assert result["placements"]["up.lora_A.weight"] == "(Replicate(),)"
        assert result["placements"]["up.lora_B.weight"] == "(Shard(dim=0),)"
        assert result["placements"]["down.weight"] == "(Shard(dim=1),)"


def test_a_moved_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(RowwiseParallel, "_prepare_output_fn")
    with pytest.raises(
        ti.TorchInternalsMoved, match=r"moved RowwiseParallel\._prepare_output_fn.*torch_internals\.py"
    ):
        ti.rowwise_prepare_output(None, True, nn.Linear(1, 1), None, None)
