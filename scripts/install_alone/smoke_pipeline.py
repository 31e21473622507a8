"""install_alone smoke for automodel-pipeline (torch + automodel-mesh only): the README's plain-torch
example (its whole script that calls init_distributed, needs no transformers, which the package does
not depend on, and pipelines an nn.Sequential), a 2-stage GPipe schedule on 2 CPU ranks under torchrun, reproduces the
single-process loss.

Usage: python smoke_pipeline.py README.md   (run in an empty directory; writes example.py there)
"""

import re
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn


def reference_loss() -> float:
    """The example's loss in one process (same seed, same data, whole batch)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        loss = ((model(x) - y) ** 2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


if __name__ == "__main__":
    blocks = [
        block
        for block in re.findall(r"```python\n(.*?)```", Path(sys.argv[1]).read_text(), flags=re.S)
        if "init_distributed()" in block and "transformers" not in block and "nn.Sequential(*[" in block
    ]
    assert blocks, "the README has no plain-torch python example (a script calling init_distributed())"
    Path("example.py").write_text(blocks[0])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "example.py"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    # both ranks share one stdout pipe: match each figure by its own printed shape
    losses = {int(r): float(v) for r, v in re.findall(r"rank (\d) loss (-?\d+\.\d{6})", proc.stdout)}
    assert sorted(losses) == [0, 1], proc.stdout
    expected = reference_loss()
    assert all(abs(v - expected) <= 1e-5 * abs(expected) for v in losses.values()), (losses, expected)
    print(
        f"ok automodel-pipeline: README example, 2-stage gpipe on 2 ranks, loss {losses[0]:.6f} = 1 process"
    )
