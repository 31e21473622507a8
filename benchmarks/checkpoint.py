"""Checkpoint save / restore cost on 2 gloo ranks (FSDP2 dp=2) of a small Llama, CPU.

Baseline measured in the same run: rank 0 gathering the full model + optimizer state and writing
it with one ``torch.save`` (the naive way); every rank ``torch.load``-ing that file and
``set_state_dict`` re-sharding it back. The
ratios show what the sharded DCP path (every rank writes its own shard, atomic publish, LATEST)
and the consolidated HF export cost against it.

    uv run --frozen python benchmarks/checkpoint.py [--hidden 512 --layers 4 --vocab 8192 --repeats 3]

Then the training stall per save, sync vs ``checkpoint.is_async: true``, in the same run: the same
model trains ``--steps`` steps twice from the same start, saving every ``--every`` steps; the stall
is the wall time the loop is blocked in `Checkpointer.maybe_save` / `Checkpointer.wait` (the end
of training waits for the last async save), the slowest rank's. ``--stall-only`` skips the first part.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from automodel.recipes.checkpoint import CheckpointConfig, Checkpointer, TrainingState
from automodel.recipes.strategies.base import PLAIN_PARTS
from automodel.testing.ranks import run_on_ranks


class _Loader:
    def state_dict(self) -> dict:
        return {"position": 0}

    def load_state_dict(self, sd: dict) -> None:
        pass


def _build(*, hidden: int, layers: int, vocab: int):
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randint(0, vocab, (2, 32))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    state = TrainingState(
        model_parts=[model],
        optimizers=[opt],
        lr_schedulers=[],
        dataloader=_Loader(),
        step=0,
        strategy=PLAIN_PARTS,
    )
    return model, opt, state


def _stall(*, root: str, hidden: int, layers: int, vocab: int, steps: int, every: int) -> dict[str, Any]:
    """Per mode: the loop's wall time, its time blocked in the checkpointer, and the number of saves."""
    model, opt, state = _build(hidden=hidden, layers=layers, vocab=vocab)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(start[k])
        ck = Checkpointer(
            CheckpointConfig(
                checkpoint_dir=f"{root}/stall_{mode}", save_consolidated=False, is_async=mode == "async"
            ),
            output_dir=root,
        )
        blocked, saves = 0.0, 0
        dist.barrier()
        t_loop = time.perf_counter()
        for step in range(1, steps + 1):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            state.step = step
            t0 = time.perf_counter()
            saves += ck.maybe_save(state, every_steps=every) is not None
            if step == steps:
                ck.wait()  # the end of training waits for the last save
            blocked += time.perf_counter() - t0
        loop = time.perf_counter() - t_loop
        ck.close()
        worst = torch.tensor([blocked, loop, ck.publish_s])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[f"{mode}_stall_s"], out[f"{mode}_loop_s"], out[f"{mode}_publish_s"] = worst.tolist()
        out[f"{mode}_saves"] = saves
        out["staging"] = ck.staging or out.get("staging", "")
    return out


def _bench(*, root: str, hidden: int, layers: int, vocab: int, repeats: int) -> dict[str, float]:
    model, opt, state = _build(hidden=hidden, layers=layers, vocab=vocab)
    times: dict[str, list[float]] = {
        k: [] for k in ("naive_save", "naive_load", "dcp_save", "dcp_consolidated_save", "dcp_restore")
    }

    def timed(key, fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times[key].append(time.perf_counter() - t0)

    full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for i in range(repeats):
        naive = Path(root) / f"naive_{i}.pt"

        def naive_save(naive=naive):
            msd, osd = get_state_dict(model, opt, options=full_opts)
            if dist.get_rank() == 0:
                torch.save({"model": msd, "optim": osd}, naive)

        def naive_load(naive=naive):
            full = torch.load(naive, weights_only=False)
            set_state_dict(
                model, opt, model_state_dict=full["model"], optim_state_dict=full["optim"], options=full_opts
            )

        timed("naive_save", naive_save)
        timed("naive_load", naive_load)
        for key, consolidated in (("dcp_save", False), ("dcp_consolidated_save", True)):
            state.step = 2 * i + int(consolidated) + 1
            ck = Checkpointer(
                CheckpointConfig(checkpoint_dir=f"{root}/{key}", save_consolidated=consolidated),
                output_dir=root,
            )
            timed(key, lambda ck=ck: ck.save(state))
            ck.close()
        ck = Checkpointer(CheckpointConfig(checkpoint_dir=f"{root}/dcp_save"), output_dir=root)
        timed("dcp_restore", lambda ck=ck: ck.restore(state))
        ck.close()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {k: statistics.median(v) for k, v in times.items()}
    out["params_mib"] = nbytes / 2**20  # local shard; full model is world x this
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--stall-only", action="store_true")
    a = p.parse_args()
    if not a.stall_only:
        _cost(a)
    with tempfile.TemporaryDirectory() as root:
        st = run_on_ranks(
            _stall,
            world_size=2,
            kwargs=dict(
                root=root, hidden=a.hidden, layers=a.layers, vocab=a.vocab, steps=a.steps, every=a.every
            ),
            timeout_s=1200,
        )[0]
    print(
        f"training stall, {a.steps} steps saving every {a.every} (same model, same steps; slowest rank; "
        f"async staging: {st['staging']} host memory)"
    )
    sync_per = st["sync_stall_s"] / st["sync_saves"]
    async_per = st["async_stall_s"] / st["async_saves"]
    for mode, per, ratio in (
        ("sync ", sync_per, "1.00x (baseline)"),
        ("async", async_per, f"{async_per / sync_per:.2f}x"),
    ):
        m = mode.strip()
        publish = st[f"{m}_publish_s"] / st[f"{m}_saves"]
        print(
            f"{mode} save: stall per save {per:7.3f} s (of which publish: checksums, checkpoint.json, "
            f"rename, LATEST {publish:6.3f} s)   loop {st[f'{m}_loop_s']:7.2f} s   {ratio}"
        )


def _cost(a: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as root:
        res = run_on_ranks(
            _bench,
            world_size=2,
            kwargs=dict(root=root, hidden=a.hidden, layers=a.layers, vocab=a.vocab, repeats=a.repeats),
            timeout_s=600,
        )[0]
    full_mib = res["params_mib"] * 2
    print(
        f"model: Llama hidden={a.hidden} layers={a.layers} vocab={a.vocab}, {full_mib:.1f} MiB fp32 params; 2 ranks FSDP2"
    )
    base_s, base_l = res["naive_save"], res["naive_load"]
    print(f"naive full torch.save (model+Adam)   {base_s:7.3f} s   1.00x (baseline)")
    print(f"DCP sharded save (atomic, LATEST)    {res['dcp_save']:7.3f} s   {res['dcp_save'] / base_s:.2f}x")
    print(
        f"DCP save + consolidated HF export    {res['dcp_consolidated_save']:7.3f} s   {res['dcp_consolidated_save'] / base_s:.2f}x"
    )
    print(
        f"naive torch.load + load_state_dict   {base_l:7.3f} s   1.00x (baseline, every rank reads the full file)"
    )
    print(
        f"DCP restore (model+Adam+state)       {res['dcp_restore']:7.3f} s   {res['dcp_restore'] / base_l:.2f}x"
    )


if __name__ == "__main__":
    main()
