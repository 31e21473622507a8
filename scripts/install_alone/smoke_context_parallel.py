"""install_alone smoke for automodel-context-parallel: ring attention on 2 gloo ranks = full attention."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The harness is dev-only (packages/testing, in no wheel): it comes from the source tree, while
# everything under test comes from the wheels installed in this venv (`python -I`: no workspace path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "testing" / "src"))
from automodel.context_parallel import load_balanced_indices, ring_attention
from automodel.testing.ranks import run_on_ranks


def qkv() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))


def body(rotation: str) -> float:
    q, k, v = qkv()
    idx = load_balanced_indices(8, cp_size=2, cp_rank=dist.get_rank())
    out = ring_attention(
        q[:, :, idx],
        k[:, :, idx],
        v[:, :, idx],
        cp_group=dist.group.WORLD,
        token_index=idx,
        kv_rotation=rotation,
    )
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, idx]
    return (out - expected).abs().max().item()


if __name__ == "__main__":
    for rotation in ("allgather", "p2p"):
        errors = run_on_ranks(body, world_size=2, args=(rotation,), timeout_s=120)
        assert max(errors) < 1e-5, (rotation, errors)
    print(
        f"ok automodel-context-parallel: ring attention on 2 ranks = full attention (max err {max(errors):.1e})"
    )
