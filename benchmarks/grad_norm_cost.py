"""Cost of the recipes' float64-accumulated gradient norm vs torch's float32 one, per optimizer step.

The recipes accumulate the norm's sum of squares in float64 (exact across layouts; torch's float32
norm of 1e8 values is 1% off on CPU). This times `automodel.recipes.grad_norm.total_grad_norm`
against `torch.nn.utils.get_total_norm` (foreach, float32) on the gradients of a Llama-shaped
parameter set (one tensor per weight, as a rank holds them), on CPU and, when present, on CUDA,
and prints the ratio and each result's error against an exact float64 reference.

    uv run --frozen python benchmarks/grad_norm_cost.py [--hidden 1024] [--layers 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from automodel.recipes.grad_norm import total_grad_norm


def llama_grads(hidden: int, layers: int, vocab: int, device: str) -> list[torch.nn.Parameter]:
    """Parameters (with random gradients) shaped like a Llama's: per layer q, k, v, o, gate, up,
    down and two norms; embedding, head and final norm."""
    inter, kv = int(hidden * 2.6875), hidden // 4
    shapes = [(vocab, hidden), (vocab, hidden), (hidden,)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]
        shapes += [(inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    g = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, device=device))
        p.grad = torch.randn(shape, generator=g, device=device)
        params.append(p)
    return params


def timed(fn, repeats: int, device: str) -> tuple[float, float]:
    """Median seconds of `fn` and its (last) result."""
    times: list[float] = []
    result = 0.0
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = float(fn())
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        params = llama_grads(args.hidden, args.layers, args.vocab, device)
        numel = sum(p.numel() for p in params)
        exact = float(torch.stack([p.grad.double().square().sum() for p in params]).sum().sqrt())
        grads = [p.grad for p in params]
        ours, ours_value = timed(functools.partial(total_grad_norm, params), args.repeats, device)
        theirs, theirs_value = timed(
            functools.partial(torch.nn.utils.get_total_norm, grads, foreach=True), args.repeats, device
        )
        print(f"{device}: {len(params)} gradient tensors, {numel / 1e6:.1f}M elements")
        print(
            f"  recipes total_grad_norm (float64 accumulator): {ours * 1e3:8.2f} ms, "
            f"relative error {abs(ours_value - exact) / exact:.1e}"
        )
        print(
            f"  torch get_total_norm (float32, foreach):       {theirs * 1e3:8.2f} ms, "
            f"relative error {abs(theirs_value - exact) / exact:.1e}"
        )
        print(f"  ratio recipes/torch = {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
