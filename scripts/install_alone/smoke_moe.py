"""install_alone smoke for automodel-moe-ep: the grouped expert MLP equals a per-expert loop."""

import torch
import torch.nn.functional as F

from automodel.moe import MoEParallelizerConfig, grouped_expert_mlp

if __name__ == "__main__":
    MoEParallelizerConfig()
    g = torch.Generator().manual_seed(0)
    counts, hidden, inter = [3, 0, 5], 8, 6
    x = torch.randn(sum(counts), hidden, generator=g)
    gate_up = torch.randn(len(counts), 2 * inter, hidden, generator=g)
    down = torch.randn(len(counts), hidden, inter, generator=g)
    out = grouped_expert_mlp(x, counts=counts, gate_up_proj=gate_up, down_proj=down, act_fn=F.silu)
    parts, start = [], 0
    for e, n in enumerate(counts):
        gate, up = (x[start : start + n] @ gate_up[e].T).chunk(2, dim=-1)
        parts.append((F.silu(gate) * up) @ down[e].T)
        start += n
    err = (out - torch.cat(parts)).abs().max().item()
    assert err < 1e-4, err
    print(f"ok automodel-moe-ep: grouped expert MLP = per-expert loop (max err {err:.1e})")
