"""torchrun worker for test_gpu.py: train a tiny Llama N steps with megatron_fsdp and with FSDP2.

Run: ``torchrun --nproc_per_node=N gpu_parity_worker.py --tp 1 --dtype bf16 --out losses.json``.
Both runs use the same seed, data and AdamW; the JSON holds the dp-averaged loss of each step.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from automodel.fsdp2 import apply_tp
from automodel.megatron_fsdp import (
    MegatronFSDPConfig,
    MegatronFSDPManager,
    apply_megatron_fsdp,
    resolve_unit_modules,
)
from automodel.mesh import MeshContext, ParallelismSizes, destroy_distributed, init_distributed
from automodel.testing.tiny_model import tiny_llama


def batches(ctx: MeshContext, steps: int) -> list[torch.Tensor]:
    """Each dp rank's slice of one seeded global batch, repeated (so the loss must fall); tp ranks share it."""
    dp, dp_rank = ctx.layout.dp, ctx.coordinates["dp_shard"]
    ids = torch.randint(0, 256, (2 * dp, 32), generator=torch.Generator().manual_seed(1000))
    return [ids.chunk(dp)[dp_rank].cuda() for _ in range(steps)]


def train(model, optimizer, data: list[torch.Tensor], ctx: MeshContext) -> list[float]:
    losses = []
    for ids in data:
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        value = loss.detach().float().clone()
        if ctx.layout.dp > 1:
            dist.all_reduce(value, group=ctx.get_mesh("dp").get_group())
            value /= ctx.layout.dp
        losses.append(value.item())
    return losses


def run_megatron(ctx: MeshContext, data, bf16: bool) -> list[float]:
    model = tiny_llama().cuda()  # pyright: ignore[reportCallIssue]  # @wraps'd HF method (typeshed)
    if bf16:
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    config = MegatronFSDPConfig(preserve_fp32_weights=True, grad_reduce_in_fp32=True, backend="nccl")
    if ctx.layout.dp > 1:
        model, optimizer = MegatronFSDPManager(config, ctx).parallelize(model, optimizer)
    else:
        # The manager applies TP only when dp == 1; call megatron-fsdp directly so one GPU exercises it.
        names = {id(p): n for n, p in model.named_parameters()}
        if ctx.layout.tp_enabled:
            apply_tp(model, tp_mesh=ctx.get_mesh("tp"))
        units = resolve_unit_modules(model)
        model, optimizer = apply_megatron_fsdp(
            model,
            mesh=ctx,
            config=config,
            unit_modules=units,
            optimizer=optimizer,
            optimizer_param_names=names,
        )
    assert type(model).__name__ == "MegatronFSDP", type(model)
    return train(model, optimizer, data, ctx)


def run_fsdp2(ctx: MeshContext, data, bf16: bool) -> list[float]:
    """Reference: torch's FSDP2 over dp (a 1-rank mesh is fine), bf16 params via its mixed precision."""
    model = tiny_llama().cuda()  # pyright: ignore[reportCallIssue]  # @wraps'd HF method (typeshed)
    if ctx.layout.tp_enabled:
        apply_tp(model, tp_mesh=ctx.get_mesh("tp"))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.get_mesh("dp"), mp_policy=policy)
    fully_shard(model, mesh=ctx.get_mesh("dp"), mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return train(model, optimizer, data, ctx)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's arguments (test_gpu.py's `worker_args`; a CPU test parses those too)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    init_distributed(backend="nccl")
    try:
        ctx = MeshContext.build(ParallelismSizes(tp_size=args.tp))
        data = batches(ctx, args.steps)
        bf16 = args.dtype == "bf16"
        result = {"megatron_fsdp": run_megatron(ctx, data, bf16), "fsdp2": run_fsdp2(ctx, data, bf16)}
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(
                    {**result, "device": torch.cuda.get_device_name(), "world_size": dist.get_world_size()}, f
                )
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
