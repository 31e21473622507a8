"""Single-GPU training throughput of a Llama-3.2-1B-shaped model under FSDP2: tokens/s/GPU and MFU.

    python benchmarks/gpu_throughput.py                          # plain torch vs ours: 1B, seq 4096, bf16
    python benchmarks/gpu_throughput.py --variants plain,base,compile,ac,compile+ac
    python benchmarks/gpu_throughput.py --variants plain,base,megatron   # + megatron-fsdp, same GPU
    python benchmarks/gpu_throughput.py --tiny --device cpu --steps 2 --warmup 1   # smoke test
    python benchmarks/gpu_throughput.py --variants plain         # needs no automodel at all

Variants (a comma list; parts joined by "+"):
    plain     the baseline: HF Llama + torch's own `fully_shard` (one unit per layer, root last) +
              AdamW, written here with plain torch; it imports nothing from automodel, so it runs
              where automodel is not importable. `plain+compile`, `plain+ac` add torch's
              per-layer compile / checkpoint_wrapper.
    base      the same model, step and policy through automodel.fsdp2.FSDP2Manager;
              `compile`, `ac`, `compile+ac` its per-layer compile / activation checkpointing.
    megatron  megatron-fsdp through automodel.megatron_fsdp (`megatron+ac`, `megatron+compile`).
Levers (parts added to base/compile/ac variants, e.g. `compile+chunked+liger`):
    chunked   the loss through automodel.recipes' chunked linear cross-entropy (the default of
              `recipes train`: no [tokens, vocab] logits) instead of HF's full-logits loss.
    sync      read the loss and the clipped gradient norm on the host every step, as the recipes
              loop did before it fetched them one step late (every variant clips the norm).
    liger     `kernels: {liger: true}` of `recipes train`, by the same code
              (automodel.recipes.kernels.liger): Liger's RMSNorm, RoPE and SwiGLU through its
              `_apply_liger_kernel_to_instance`; with `chunked`, Liger's fused linear CE replaces
              ours in the recipes' head loss. Refused before any variant runs where the recipe
              refuses it (no CUDA, liger-kernel not importable); the family patch is undone after
              the variant (it is process-wide), so later variants run HF's own modules.
    fp8       `fp8:` of `recipes train` with NeMo AutoModel's example section (tensorwise, float8
              all-gather, precomputed scales after each optimizer step, weight recomputed in
              backward, lm_head kept), by the same code (automodel.recipes.kernels.float8);
              refused where the recipe refuses it (torchao missing, compute capability < 8.9).

Random init (no download). Each variant builds a fresh model, runs `--warmup` untimed steps and
`--steps` timed steps and reports the median. On GPU each step is timed by CUDA events read once
after the last step (the host is never made to wait between steps, so a variant that syncs inside
its step shows the GPU idling as step time); on CPU by perf_counter. Between variants the previous
model is garbage-collected before the peak-memory counter is reset: FSDP-wrapped modules hold
reference cycles, and without `gc.collect()` the previous variant's parameters, gradients and
optimizer state stayed allocated into the next variant's peak (the `base` after `plain` figure
of 36.3 vs 26.9 GiB on H200 was that, not automodel). Ratios are
tokens/s against the `plain` variant measured in the same run (against the first variant when
`plain` is not in the list). The process group (one rank) is set up with plain torch.distributed.

FLOPs per token (the torchtitan / PaLM-appendix-B convention):
    6 * N  +  12 * L * H * Dh * S
N = parameters that take part in matmuls (all parameters except an untied input-embedding
table; a tied embedding counts once, as the LM head), L layers, H query heads, Dh head dim,
S sequence length. The attention term counts QK^T and AV forward+backward over the full
S x S square (no causal halving), as torchtitan does. MFU = FLOPs/token * tokens/s / peak;
the peak defaults to 989 TFLOP/s (H100 SXM dense bf16), set --peak-tflops for other parts.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # imported where used: `--help` and the plain variant's import stay light
    from transformers import LlamaForCausalLM


H100_SXM_BF16_DENSE_TFLOPS = 989.0

LLAMA_3_2_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


@dataclass
class Result:
    variant: str
    median_step_s: float
    tokens_per_s_per_gpu: float
    tflops_per_s: float
    mfu: float
    peak_mem_gib: float
    held_before_gib: float
    fsdp: str


def flops_per_token(model: LlamaForCausalLM, shape: dict, seq_len: int) -> float:
    """6 * N + 12 * L * H * Dh * S (see the module docstring for N)."""
    n = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if not shape["tie_word_embeddings"]:
        n -= embed.numel()
    attention = 12 * shape["num_hidden_layers"] * shape["num_attention_heads"] * shape["head_dim"] * seq_len
    return 6 * n + attention


def build_model(shape: dict, seq_len: int, device: torch.device) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=max(seq_len, 64), use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with device:
        return LlamaForCausalLM(config)


def parallelize_plain(model: LlamaForCausalLM, *, dtype: torch.dtype, compile_layers: bool, ac: bool) -> str:
    """The baseline, plain torch only: `fully_shard` per decoder layer then the root, `dtype` params /
    fp32 reduce; optional checkpoint_wrapper (AC) and per-layer compile. No automodel import."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if ac:
            layers[i] = layer = checkpoint_wrapper(layer)
        if compile_layers:
            layer.compile()
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return "torch.distributed.fsdp.fully_shard (plain torch)"


def _import_automodel_or_exit(variant: str) -> None:
    try:
        import automodel.fsdp2  # noqa: F401
        import automodel.mesh  # noqa: F401
    except ImportError as err:
        raise SystemExit(
            f"variant {variant!r} needs automodel importable ({err}): put packages/*/src on PYTHONPATH "
            "or use the workspace environment; the `plain` variant runs without it"
        ) from err


def parallelize(model: torch.nn.Module, *, dtype: torch.dtype, compile_layers: bool, ac: bool) -> str:
    """automodel FSDP2 (one unit per layer, root last) with `dtype` params / fp32 reduce; AC and compile."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel.fsdp2 import FSDP2Config, FSDP2Manager
    from automodel.mesh import MeshContext, ParallelismSizes

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    ctx = MeshContext.build(ParallelismSizes())
    config = FSDP2Config(mp_policy=policy, activation_checkpointing=ac, enable_compile=compile_layers)
    FSDP2Manager(config, ctx).parallelize(model)
    return "automodel.fsdp2.FSDP2Manager"


def parallelize_megatron(
    model: LlamaForCausalLM, *, dtype: torch.dtype, compile_layers: bool, ac: bool
) -> str:
    """megatron-fsdp (ZeRO-3, one unit per decoder layer) on the same GPU: params in `dtype`,
    fp32 main weights and fp32 gradient reduction; AC on each layer's MLP (megatron-fsdp's AC scope)."""
    from automodel.megatron_fsdp import (
        MegatronFSDPConfig,
        apply_megatron_fsdp,
        apply_mlp_checkpointing,
        resolve_unit_modules,
    )
    from automodel.mesh import MeshContext, ParallelismSizes

    model.to(dtype)
    units = resolve_unit_modules(model)
    if ac:
        apply_mlp_checkpointing(model, unit_modules=units)
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    config = MegatronFSDPConfig(
        preserve_fp32_weights=True, grad_reduce_in_fp32=True, activation_checkpointing=ac
    )
    ctx = MeshContext.build(ParallelismSizes())
    # apply_megatron_fsdp directly: the manager applies TP only when dp == 1.
    wrapped, _ = apply_megatron_fsdp(model, mesh=ctx, config=config, unit_modules=units)
    model.__dict__["_benchmark_wrapper"] = wrapped
    return "automodel.megatron_fsdp.apply_megatron_fsdp"


def time_steps(step: Callable[[], None], *, count: int, device: torch.device) -> list[float]:
    """Seconds per step of `count` steps: CUDA events read after the last one (no host wait in
    between), perf_counter per step on CPU."""
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)
        ]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1000.0 for start, end in events]
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def clip_local_grads(params: list[torch.nn.Parameter], *, max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` by the global norm; one rank holds every shard, so the local gradients
    (of DTensors too) are the whole gradient. Plain torch, no host wait."""
    from torch.distributed.tensor import DTensor

    grads = [
        p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None
    ]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


LEVERS = {"chunked", "sync", "liger", "fp8"}


def check_levers(variants: list[str], device: torch.device) -> None:
    """Refuse (SystemExit) before any variant runs what `recipes train` refuses on this machine
    (the recipes' own checks): Liger without CUDA or its package, fp8 without torchao or below
    compute capability 8.9."""
    parts = set().union(*(variant_parts(v) for v in variants))
    if "liger" in parts:
        from automodel.recipes.kernels.liger import liger_unavailable

        if why := liger_unavailable():
            raise SystemExit(f"variant part 'liger': {why}")
    if "fp8" in parts:
        from automodel.recipes.config.kernels import AUTOMODEL_EXAMPLE_FP8 as AUTOMODEL_FP8
        from automodel.recipes.kernels import FP8Section
        from automodel.recipes.kernels.float8 import fp8_unavailable

        if device.type != "cuda":
            raise SystemExit("variant part 'fp8' needs a CUDA GPU of compute capability >= 8.9")
        if refusal := fp8_unavailable(FP8Section(**AUTOMODEL_FP8)):
            raise SystemExit(f"variant part 'fp8': {refusal[1]}")


def apply_levers(model: torch.nn.Module, parts: set[str]) -> Callable[[], None]:
    """Liger's kernels and the float8 conversion on the model before it is sharded, by the
    recipes' code; returns what undoes Liger's process-wide patch of modeling_llama."""
    undo: Callable[[], None] = lambda: None  # noqa: E731
    if "liger" in parts:
        from automodel.recipes.kernels import KernelsSection
        from automodel.recipes.kernels.liger import apply_liger_kernels, resolve_patches

        head = None if "chunked" in parts else "HF's full-logits loss (no chunked part)"
        patches = resolve_patches(KernelsSection(liger=True), model_type="llama", chunked_head=head)
        undo = apply_liger_kernels(model, patches=patches).undo
    if "fp8" in parts:
        from automodel.recipes.config.kernels import AUTOMODEL_EXAMPLE_FP8 as AUTOMODEL_FP8
        from automodel.recipes.kernels import FP8Section
        from automodel.recipes.kernels.float8 import convert_to_fp8

        convert_to_fp8(model, section=FP8Section(**AUTOMODEL_FP8), keep=("lm_head",))
    return undo


def make_loss(
    model: torch.nn.Module, parts: set[str], *, meta_model: torch.nn.Module | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``loss(ids)``: the mean next-token CE of the model on `ids`, by the variant's loss path.

    The chunked loss decides on `meta_model` (the same architecture on the meta device, as the
    recipes decide before materializing) whether it reproduces the model's logits; the probe's
    meta inputs cannot run through the real model."""
    if "chunked" not in parts:
        return lambda ids: model(input_ids=ids, labels=ids).loss
    from automodel.recipes.loss import LinearCrossEntropy, masked_cross_entropy_sum
    from automodel.recipes.output_head import build_head_loss

    assert meta_model is not None, "the chunked loss needs the meta-device model to probe"

    # the recipes' path: the whole (FSDP root) forward runs with the head recording its input
    head_loss = build_head_loss(LinearCrossEntropy(), model=meta_model, logits_loss=masked_cross_entropy_sum)
    if not head_loss.plan.chunked:
        raise SystemExit(f"chunked: {head_loss.plan.describe()}")
    head_loss.bind([model])

    def shifted(ids: torch.Tensor) -> torch.Tensor:
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        return labels

    if "liger" in parts:  # as `recipes train` with kernels.liger: true (kernels.apply)
        from automodel.recipes.kernels.liger import liger_linear_cross_entropy_sum

        head_loss.linear_loss = liger_linear_cross_entropy_sum

    def chunked_loss(ids: torch.Tensor) -> torch.Tensor:
        labels = shifted(ids)
        with head_loss.capturing():
            out = model(input_ids=ids)
            return head_loss(out.logits, labels) / (labels != -100).sum()

    return chunked_loss


def variant_parts(variant: str) -> set[str]:
    """The parts of one `--variants` entry ("base" dropped), checked; ValueError names the bad entry."""
    parts = set(variant.split("+"))
    unknown = parts - {"base", "plain", "compile", "ac", "megatron"} - LEVERS
    if unknown:
        raise ValueError(
            f"--variants: unknown part(s) {sorted(unknown)} in {variant!r}; use plain, base, compile, ac, "
            f"megatron and the levers {', '.join(sorted(LEVERS))}"
        )
    if "plain" in parts and parts & (LEVERS - {"sync"}):
        raise ValueError(f"--variants: {variant!r}: plain imports nothing from automodel; levers go on base")
    if "plain" in parts and parts & {"base", "megatron"}:
        raise ValueError(f"--variants: {variant!r} mixes plain (the torch-only baseline) with base/megatron")
    if "megatron" in parts and "base" in parts:
        raise ValueError(f"--variants: {variant!r} mixes base (automodel FSDP2) with megatron")
    return parts - {"base"}


def run_variant(variant: str, args: argparse.Namespace, shape: dict, device: torch.device) -> Result:
    parts = variant_parts(variant)
    if "plain" in parts:
        apply = parallelize_plain
    else:
        apply = parallelize_megatron if "megatron" in parts else parallelize
    # what earlier variants still hold: ~0 when they were released (counts towards this peak otherwise)
    held_before = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    model = build_model(shape, args.seq_len, device)
    flops = flops_per_token(model, shape, args.seq_len)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    undo_liger = apply_levers(model, parts)
    how = apply(model, dtype=dtype, compile_layers="compile" in parts, ac="ac" in parts)
    model = model.__dict__.pop("_benchmark_wrapper", model)
    # foreach AdamW for both strategies (megatron-fsdp's uneven DTensor shards are not tested with fused).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if "megatron" in parts:
        from automodel.megatron_fsdp import shard_optimizer

        optimizer = shard_optimizer(optimizer)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (args.batch_size, args.seq_len), generator=gen).to(device)

    meta_model = build_model(shape, args.seq_len, torch.device("meta")) if "chunked" in parts else None
    loss_of = make_loss(model, parts, meta_model=meta_model)
    # clipped like the recipes loop (megatron-fsdp clips through its own optimizer wrapper)
    params = [] if "megatron" in parts else [p for p in model.parameters() if p.requires_grad]
    after_step: Callable[[], None] = lambda: None  # noqa: E731
    if "fp8" in parts:  # the recipes' after-step hook (fp8.precompute_float8_dynamic_scale_for_fsdp)
        from automodel.recipes.kernels.float8 import precompute_scales

        after_step = precompute_scales([model])

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(ids)
        loss.backward()
        norm = clip_local_grads(params, max_norm=1.0) if params else loss
        if "sync" in parts:  # what the loop did every step before: wait for both on the host
            _ = float(loss), float(norm)
        optimizer.step()
        after_step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        time_steps(step, count=args.warmup, device=device)
        times = time_steps(step, count=args.steps, device=device)
    finally:
        undo_liger()
    median = statistics.median(times)
    tokens_per_s = args.batch_size * args.seq_len / median
    achieved = flops * tokens_per_s
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return Result(
        variant=variant,
        median_step_s=median,
        tokens_per_s_per_gpu=tokens_per_s,
        tflops_per_s=achieved / 1e12,
        mfu=achieved / (args.peak_tflops * 1e12),
        peak_mem_gib=peak_mem,
        held_before_gib=held_before,
        fsdp=how,
    )


def torchtitan_note() -> str:
    """torchtitan is compared only when importable; say why not otherwise."""
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan not importable here: no torchtitan comparison in this run"
    return (
        "torchtitan is importable, but its trainer is config-driven: run its llama3 1B toml for a comparison"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="tiny Llama (hidden 64, 2 layers) for smoke tests"
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--seq-len", type=int, default=None, help="default 4096 (32 with --tiny)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument(
        "--variants",
        default="plain,base",
        help="comma list: plain (torch-only baseline, ratios are against it), base (automodel FSDP2), "
        "compile, ac, compile+ac, plain+compile, megatron (megatron-fsdp), megatron+ac, ...",
    )
    parser.add_argument("--peak-tflops", type=float, default=H100_SXM_BF16_DENSE_TFLOPS)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 32 if args.tiny else 4096
    for key in ("seq_len", "batch_size", "steps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants:
        parser.error("--variants is empty")
    for variant in args.variants:
        try:
            variant_parts(variant)
        except ValueError as err:
            parser.error(str(err))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "no CUDA: --device cuda but torch.cuda.is_available() is False (use --tiny --device cpu)"
        )
    return args


def init_single_process_group(device: torch.device) -> None:
    """World of one (this process) with plain torch.distributed: NCCL on CUDA, gloo on CPU.

    Under torchrun (RANK/WORLD_SIZE set) the launcher's rendezvous is used; otherwise a private
    TCP store on a free port, so nothing from automodel is needed to set up the group.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)


def release_variant(device: torch.device) -> None:
    """Free the finished variant's model, gradients and optimizer before the next one is measured.

    FSDP2 modules sit in reference cycles (module <-> FSDP state), so the model and its gradients
    outlive `run_variant` until the cyclic collector runs, which a GPU loop that allocates few
    Python objects rarely triggers: the next variant's peak then included them (9.2 GiB of fp32
    parameters and gradients of the 1B shape; `base` after `plain` read 36.3 GiB vs 26.9).
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    for variant in args.variants:
        if "plain" not in variant_parts(variant):
            _import_automodel_or_exit(variant)  # before any variant runs, not after the baseline
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    own_group = not dist.is_initialized()
    if own_group:
        init_single_process_group(device)
    try:
        if dist.get_world_size() != 1:
            raise SystemExit("gpu_throughput.py measures one GPU: run it as a single process")
        shape = TINY if args.tiny else LLAMA_3_2_1B
        results = []
        check_levers(args.variants, device)
        for variant in args.variants:
            results.append(run_variant(variant, args, shape, device))
            release_variant(device)
    finally:
        if own_group:
            dist.barrier()  # destroying without it can abort a rank still in flight
            dist.destroy_process_group()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    reference = "plain" if "plain" in args.variants else args.variants[0]
    ref_tokens = results[args.variants.index(reference)].tokens_per_s_per_gpu
    report = {
        "device": name,
        "torch": torch.__version__,
        "shape": "tiny" if args.tiny else "llama-3.2-1b",
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "dtype": args.dtype,
        "peak_tflops": args.peak_tflops,
        "steps": args.steps,
        "warmup": args.warmup,
        "torchtitan": torchtitan_note(),
        "ratio_to": reference,
        "results": [{**asdict(r), "ratio": r.tokens_per_s_per_gpu / ref_tokens} for r in results],
    }
    print(
        f"device={name} torch={torch.__version__} shape={report['shape']} seq={args.seq_len} bs={args.batch_size} "
        f"dtype={args.dtype} peak={args.peak_tflops} TFLOP/s steps={args.steps} (median, {args.warmup} warm-up)"
    )
    vs = f"vs {reference}"
    print(
        f"{'variant':<20} {'step s':>9} {'tok/s/GPU':>11} {'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9} {vs:>11}"
    )
    for r in results:
        print(
            f"{r.variant:<20} {r.median_step_s:>9.4f} {r.tokens_per_s_per_gpu:>11.1f} {r.tflops_per_s:>9.2f} "
            f"{r.mfu:>7.2%} {r.peak_mem_gib:>9.2f} {r.tokens_per_s_per_gpu / ref_tokens:>10.3f}x"
        )
    others = [r for r in results if r.variant != reference]
    ratios = ", ".join(f"{r.variant}/{reference} {r.tokens_per_s_per_gpu / ref_tokens:.3f}x" for r in others)
    print(f"ratio (tokens/s, same run): {ratios or f'{reference} only, nothing to compare'}")
    print("via: " + "; ".join(f"{r.variant}: {r.fsdp}" for r in results) + f"; {report['torchtitan']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
