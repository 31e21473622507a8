"""Step time of `automodel.fsdp2` vs a minimal hand-written ``fully_shard`` loop (same model, same ranks).

    uv run --frozen python benchmarks/fsdp2_overhead.py --world-size 2 --steps 10

Both variants live in the same rank processes and are timed in alternating rounds (median of
the rounds), so machine noise hits both alike. Prints the ratio package / hand-written.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from automodel.fsdp2 import FSDP2Config, FSDP2Manager
from automodel.mesh import MeshContext, ParallelismSizes
from automodel.testing.ranks import run_on_ranks


def _model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _hand_written(model: LlamaForCausalLM, mesh: MeshContext) -> torch.nn.Module:
    dp = mesh.get_mesh("dp_shard_cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()


def _bench(args: argparse.Namespace) -> dict[str, float]:
    mesh = MeshContext.build(ParallelismSizes())
    config = FSDP2Config(backend="gloo", mp_policy=MixedPrecisionPolicy())
    variants = {
        "automodel.fsdp2": FSDP2Manager(config, mesh).parallelize(_model(args)),
        "hand-written fully_shard": _hand_written(_model(args), mesh),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in variants.items()}
    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {k: [] for k in variants}
    for k, m in variants.items():
        for _ in range(args.warmup):
            _step(m, opts[k], ids)
    for _ in range(args.steps):
        for k, m in variants.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            _step(m, opts[k], ids)
            torch.distributed.barrier()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    result = run_on_ranks(_bench, world_size=args.world_size, args=(args,), timeout_s=1800)[0]
    base = result["hand-written fully_shard"]
    print(
        f"world_size={args.world_size} hidden={args.hidden} layers={args.layers} seq={args.seq} batch={args.batch} fp32 gloo CPU"
    )
    for name, t in result.items():
        print(f"  {name:28s} median step {t * 1e3:8.1f} ms   ratio vs hand-written {t / base:.3f}")


if __name__ == "__main__":
    main()
