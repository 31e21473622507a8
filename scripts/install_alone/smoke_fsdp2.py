"""install_alone smoke for automodel-fsdp2: FSDP2 over 2 forked gloo ranks equals one process."""

import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

# The harness is dev-only (packages/testing, in no wheel): it comes from the source tree, while
# everything under test comes from the wheels installed in this venv (`python -I`: no workspace path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "testing" / "src"))
from automodel.fsdp2 import FSDP2Config, apply_fsdp2_sharding_recursively, translate_to_torch_parallel_style
from automodel.mesh import MeshContext, ParallelismSizes
from automodel.testing.ranks import run_on_ranks


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def losses(sharded: bool) -> list[float]:
    torch.manual_seed(0)
    model = Tiny()
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    if sharded:
        mesh = MeshContext.build(ParallelismSizes())
        apply_fsdp2_sharding_recursively(model, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(3):  # every rank sees the same batch: averaged gradients equal one process's
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def body() -> list[float]:
    return losses(sharded=True)


if __name__ == "__main__":
    FSDP2Config(sequence_parallel=True)
    translate_to_torch_parallel_style("colwise")
    expected = losses(sharded=False)
    for rank_losses in run_on_ranks(body, world_size=2, timeout_s=180):
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(rank_losses, expected)), (
            rank_losses,
            expected,
        )
    print(f"ok automodel-fsdp2: FSDP2 on 2 ranks = 1 process, losses {[round(v, 6) for v in expected]}")
