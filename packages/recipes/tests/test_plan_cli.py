"""`recipes plan`: ranked layouts with memory and step-time estimates; bad input names the flag."""

from __future__ import annotations

import pytest

from automodel.recipes.cli import run_cli


def test_plan_8b_on_8_gpus_prints_table_breakdown_and_yaml(capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "128"]
    assert run_cli(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "8.03 B parameters" in out
    assert "peak GiB" in out and "tok/s/GPU" in out
    assert "estimated per-rank peak" in out and "activations" in out and "logits" in out
    assert "distributed:\n  strategy: fsdp2" in out
    rows = [line.split() for line in out.splitlines() if line[:2].strip().isdigit()]
    peaks = [float(r[-4]) for r in rows]
    assert rows and all(p <= 80 * 0.9 for p in peaks)  # only layouts that fit are listed


def test_smaller_gpu_memory_drops_layouts(capsys: pytest.CaptureFixture) -> None:
    base = ["plan", "--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "8192", "--top", "50"]
    assert run_cli(base) == 0
    big = sum(1 for line in capsys.readouterr().out.splitlines() if line[:2].strip().isdigit())
    assert run_cli([*base, "--gpu-memory", "24GiB"]) == 0
    small = sum(1 for line in capsys.readouterr().out.splitlines() if line[:2].strip().isdigit())
    assert 0 < small < big


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--model", "no/such-model", "--gpus", "8", "--seq-len", "4096"], "--model='no/such-model'"),
        (["--model", "llama3.1-8b", "--gpus", "0", "--seq-len", "4096"], "--gpus=0"),
        (
            ["--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "4096", "--gpu-memory", "lots"],
            "--gpu-memory='lots'",
        ),
        (["--model", "llama3.1-8b", "--gpus", "12", "--seq-len", "4096"], "--gpus=12"),
        (["--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "4096", "--peft", "qlora"], "--peft='qlora'"),
        (["--model", "llama3.1-8b", "--gpus", "1", "--seq-len", "8192", "--gpu-memory", "8GiB"], "--gpus=1"),
    ],
)
def test_bad_input_names_the_flag(args: list[str], key: str, capsys: pytest.CaptureFixture) -> None:
    assert run_cli(["plan", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0], err
