"""install_alone smoke for automodel-mesh: 2 forked gloo ranks build a MeshContext and all-reduce."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

# The harness is dev-only (packages/testing, in no wheel): it comes from the source tree, while
# everything under test comes from the wheels installed in this venv (`python -I`: no workspace path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "testing" / "src"))
from automodel.mesh import MeshContext, ParallelismSizes
from automodel.testing.ranks import run_on_ranks


def body(x: int) -> tuple[int, str, int]:
    ctx = MeshContext.build(ParallelismSizes())
    t = torch.tensor([dist.get_rank() * x])
    dist.all_reduce(t, group=ctx.get_mesh("dp_shard").get_group())
    return dist.get_rank(), ctx.layout.describe(), int(t.item())


if __name__ == "__main__":
    out = run_on_ranks(body, world_size=2, args=(10,), timeout_s=120)
    assert [r for r, _, _ in out] == [0, 1] and all(s == 10 for _, _, s in out), out
    print(f"ok automodel-mesh: {out[0][1]}; all-reduce over dp_shard = {out[0][2]}")
