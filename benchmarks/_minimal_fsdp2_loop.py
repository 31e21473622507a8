"""A minimal hand-written FSDP2 training loop (the baseline of e2e_throughput.py); run under torchrun.

    torchrun --nproc-per-node 2 benchmarks/_minimal_fsdp2_loop.py --hidden 256 --layers 4 ...

Prints one JSON line per step on rank 0: {"step", "step_time_s", "tokens_per_s"}.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--local-batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
        max_position_embeddings=a.seq, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, a.steps + 1):
        start = time.perf_counter()
        ids = torch.randint(0, a.vocab, (a.local_batch, a.seq), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)  # the loss a user logs each step
        elapsed = time.perf_counter() - start
        if rank == 0:
            tokens = a.local_batch * (a.seq - 1) * world
            print(
                json.dumps({"step": step, "step_time_s": elapsed, "tokens_per_s": tokens / elapsed}),
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
