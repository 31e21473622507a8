"""The README's whole-script examples, as written, under ``torchrun --nproc_per_node 2`` (gloo/CPU).

The code is read from README.md itself, so the README is what is tested: each script exits 0, prints
its losses, and ends without a warning at ``destroy_distributed()`` (a user's script keeps ``pipe``
in scope until then; its process groups' gloo threads once outlived the teardown).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from automodel.testing.ranks import run_torchrun

README = Path(__file__).parents[1] / "README.md"


def readme_script(*, hf: bool, containing: str = "") -> str:
    """The README's first whole script (one that calls init_distributed()) with or without
    transformers, among those `containing` a piece of code."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    scripts = [
        b for b in blocks if "init_distributed()" in b and ("transformers" in b) == hf and containing in b
    ]
    assert scripts, f"README.md has no {'transformers' if hf else 'plain-torch'} script with {containing!r}"
    return scripts[0]


def _run(tmp_path: Path, script: str) -> tuple[str, str]:
    path = tmp_path / "example.py"
    path.write_text(script)
    proc = run_torchrun(path, nproc_per_node=2, timeout_s=300, cwd=tmp_path)
    for warning in ("outlive", "RuntimeWarning", "terminate called"):
        assert warning not in proc.stderr, proc.stderr[-4000:]
    return proc.stdout, proc.stderr


def _sequential_reference_loss() -> float:
    """The plain-torch example in one process: same seed, data and optimizer, whole batch."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss = torch.zeros(())
    for _ in range(3):
        loss = ((model(x) - y) ** 2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


def test_readme_plain_torch_example_runs_and_ends_cleanly(tmp_path: Path) -> None:
    stdout, _ = _run(tmp_path, readme_script(hf=False, containing="nn.Sequential(*["))
    losses = {int(r): float(v) for r, v in re.findall(r"rank (\d) loss (-?\d+\.\d+)", stdout)}
    assert sorted(losses) == [0, 1], stdout
    assert losses[0] == pytest.approx(_sequential_reference_loss(), rel=1e-5)


def test_readme_hf_example_runs_and_ends_cleanly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    stdout, _ = _run(tmp_path, readme_script(hf=True))
    steps = re.findall(r"rank (\d) step (\d) loss (\d+\.\d+)", stdout)
    assert sorted((int(r), int(s)) for r, s, _ in steps) == [(r, s) for r in (0, 1) for s in range(3)], stdout


def _tiny_lm_reference(script: str) -> tuple[list[float], float]:
    """The tied TinyLM script in one process: its class (the script's code before it starts the
    ranks), the same seed, data and optimizer; each step's loss and the tied weight's norm after."""
    namespace: dict = {}
    exec(script.split("init_distributed()\n", 1)[0], namespace)  # imports and the class
    torch.manual_seed(0)
    model = namespace["TinyLM"]()
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        logits = model(ids)
        loss = (
            nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            / labels.numel()
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.tok_embeddings.weight.detach().double().norm().item()


def test_readme_tied_model_listed_once_runs_and_equals_one_process(tmp_path: Path) -> None:
    """Each module of the tie listed once, where it sits: the losses and, on both ranks, the tied
    weight after the steps equal one process. Both ranks share one stdout pipe (a line's end may
    come after the other rank's line): each figure is matched by its own printed shape."""
    script = readme_script(hf=False, containing="class TinyLM")
    stdout, _ = _run(tmp_path, script)
    ref_losses, ref_norm = _tiny_lm_reference(script)
    steps = {
        (int(r), int(s)): float(v) for r, s, v in re.findall(r"rank (\d) step (\d) loss (\d+\.\d{6})", stdout)
    }
    assert sorted(steps) == [(r, s) for r in (0, 1) for s in range(3)], stdout
    for (_, step), loss in steps.items():
        assert loss == pytest.approx(ref_losses[step], rel=1e-5)
    norms = dict(re.findall(r"rank (\d) tied norm (\d\.\d{9}e[+-]\d+)", stdout))
    assert sorted(norms) == ["0", "1"], stdout
    assert norms["0"] == norms["1"], norms  # the two copies, to the last printed digit
    assert float(norms["0"]) == pytest.approx(ref_norm, rel=1e-6)
