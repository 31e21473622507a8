"""`recipes train` on one GPU at the Llama-3.2-1B shape: tokens/s, MFU and peak memory per variant.

    python benchmarks/recipes_gpu_1b.py                                  # fp32-master and bf16, compiled
    python benchmarks/recipes_gpu_1b.py --variants bf16,bf16-eager --steps 20 --warmup 5
    python benchmarks/recipes_gpu_1b.py --tiny --device cpu --steps 2 --warmup 0 --variants fp32-master-eager

Each variant is the real CLI (`python -m automodel.recipes.cli train CFG --nproc-per-node 1`) on a
config written here: the 1B shape (16 layers, hidden 2048, FFN 8192, 32/8 heads, head_dim 64, vocab
128256, tied embeddings, rope theta 500000), sdpa, random init, seq 4096, batch 1, fused AdamW, the
embedded byte-level data (token ids < 256: the throughput does not depend on the ids), no checkpoints.

Variants (comma list):
    fp32-master   model.dtype float32 (fp32 master weights and optimizer state), FSDP2's default mixed
                  precision (bf16 compute, fp32 gradient reduction), per-layer compile
    bf16          model.dtype bfloat16: weights, gradients and optimizer state in bf16, compiled
    *-eager       the same without compile
    bf16-liger    bf16 with ``kernels: {liger: true}`` (Liger's RMSNorm, RoPE, SwiGLU and fused
                  linear CE instead of the chunked one; needs liger-kernel: automodel-recipes[kernels])
    bf16-fp8      bf16 with NeMo AutoModel's example ``fp8:`` section (torchao float8 tensorwise,
                  float8 all-gather, precomputed scales, lm_head kept; needs torchao:
                  automodel-recipes[fp8], compute capability >= 8.9)
    bf16-fp8-liger  both

The figures are the run's own `metrics.jsonl` (tokens_per_s, peak_mem_bytes per step): median
tokens/s over the steps after `--warmup`, the largest peak. MFU = tokens/s x FLOPs/token / peak
(FLOPs/token as in benchmarks/gpu_throughput.py: 9,025,499,136 for this shape; 989 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_throughput import H100_SXM_BF16_DENSE_TFLOPS, LLAMA_3_2_1B, TINY  # noqa: E402

from automodel.recipes.config.kernels import AUTOMODEL_EXAMPLE_FP8 as AUTOMODEL_FP8  # noqa: E402

VARIANTS = (
    "fp32-master", "bf16", "fp32-master-eager", "bf16-eager", "bf16-liger", "bf16-fp8", "bf16-fp8-liger",
)  # fmt: skip


def model_config(shape: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """`model.config` of the YAML: a Llama of `shape`, sdpa."""
    return {
        "model_type": "llama",
        **shape,
        "max_position_embeddings": max(seq_len, 64),
        "use_cache": False,
    }


def flops_per_token(shape: dict[str, Any], seq_len: int) -> int:
    """6 * N + 12 * L * H * Dh * S with N the matmul parameters (a tied embedding counted once)."""
    h, f, layers, vocab = (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_hidden_layers"],
        shape["vocab_size"],
    )
    q_out = shape["num_attention_heads"] * shape["head_dim"]
    kv_out = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * q_out + 2 * h * kv_out + q_out * h + 3 * h * f + 2 * h
    n = layers * per_layer + vocab * h + h  # + LM head (the tied table) + final norm
    attention = 12 * layers * shape["num_attention_heads"] * shape["head_dim"] * seq_len
    return 6 * n + attention


def recipe(variant: str, *, out: Path, shape: dict[str, Any], seq_len: int, steps: int, device: str) -> dict:
    """The `recipes train` config of one variant."""
    if variant not in VARIANTS:
        raise ValueError(f"--variants: unknown variant {variant!r}; use {', '.join(VARIANTS)}")
    bf16 = variant.startswith("bf16")
    speedups: dict[str, Any] = {}
    if "-liger" in variant:
        speedups["kernels"] = {"liger": True}
    if "-fp8" in variant:
        speedups["fp8"] = dict(AUTOMODEL_FP8)
    return {
        **speedups,
        "seed": 0,
        "output_dir": str(out),
        "model": {
            "config": model_config(shape, seq_len),
            "dtype": "bfloat16" if bf16 else "float32",
            "attn_implementation": "sdpa",
        },
        "dataset": {
            "source": "embedded",
            "seq_length": seq_len,
            "max_bytes": max(4096, (steps + 2) * (seq_len + 1) * 2),
        },
        "step_scheduler": {
            "global_batch_size": 1,
            "local_batch_size": 1,
            "max_steps": steps,
            "val_every_steps": None,
        },
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-4, "fused": device == "cuda"},
        "distributed": {"strategy": "fsdp2", "enable_compile": not variant.endswith("-eager")},
        "checkpoint": {"enabled": False},
        "logging": {"progress_bar": False},
    }


def summarize(records: list[dict[str, Any]], *, warmup: int, flops: int, peak_tflops: float) -> dict:
    """Median tokens/s after `warmup` steps, MFU, the largest peak memory."""
    timed = [r for r in records if r["step"] > warmup]
    if not timed:
        raise ValueError(f"no step after the {warmup} warm-up steps ({len(records)} records)")
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in timed)
    return {
        "steps_timed": len(timed),
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops / (peak_tflops * 1e12),
        "peak_mem_gib": max(r["peak_mem_bytes"] for r in records) / 2**30,
        "final_loss": records[-1]["loss"],
    }


def run(variant: str, args: argparse.Namespace, work: Path) -> dict:
    shape = TINY if args.tiny else LLAMA_3_2_1B
    out = work / variant
    cfg = work / f"{variant}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            recipe(variant, out=out, shape=shape, seq_len=args.seq_len, steps=args.steps, device=args.device)
        )
    )
    cmd = [sys.executable, "-m", "automodel.recipes.cli", "train", str(cfg), "--nproc-per-node", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"{variant}: recipes train exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    flops = flops_per_token(shape, args.seq_len)
    return {
        "variant": variant,
        **summarize(records, warmup=args.warmup, flops=flops, peak_tflops=args.peak_tflops),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="fp32-master,bf16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--seq-len", type=int, default=None, help="default 4096 (32 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny Llama for smoke tests")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--peak-tflops", type=float, default=H100_SXM_BF16_DENSE_TFLOPS)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per variant")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.seq_len = args.seq_len or (32 if args.tiny else 4096)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for variant in args.variants:
        if variant not in VARIANTS:
            parser.error(f"--variants: unknown variant {variant!r}; use {', '.join(VARIANTS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error(
                "no CUDA: --device cuda but torch.cuda.is_available() is False (use --tiny --device cpu)"
            )
    if args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    return args


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else device


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="recipes_gpu_1b.") as tmp:
        results = [run(variant, args, Path(tmp)) for variant in args.variants]
    report = {
        "shape": "tiny" if args.tiny else "llama-3.2-1b",
        "seq_len": args.seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "peak_tflops": args.peak_tflops,
        "device": device_name(args.device),
        "results": results,
    }
    print(f"recipes train, {report['shape']} seq {args.seq_len} batch 1, median after step {args.warmup}")
    for r in results:
        print(
            f"  {r['variant']:<18} {r['tokens_per_s']:>10,.0f} tok/s  MFU {r['mfu']:6.1%}  "
            f"peak {r['peak_mem_gib']:5.1f} GiB  loss {r['final_loss']:.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
