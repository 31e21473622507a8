"""SFT step time with micro-batches padded to their longest example vs to ``seq_length`` (CPU, same run).

Trains a Llama (hidden 256, 4 layers, fp32, AdamW) through the recipes' own `Trainer` on fsdp2
dp=2 (2 forked gloo ranks) on SQuAD-shaped instruction rows (a context of 60-300 characters, a
question, a short answer; byte-level tokenizer, answer-only loss), ``dataset.seq_length: 1024``,
twice: once as the trainer pads today (each micro-batch to its longest example rounded up to 64)
and once with every row padded to ``seq_length`` (`PAD_MULTIPLE` set to 1024 in the ranks: the
rows before this change). Prints the median step time of the timed steps, the tokens a step
computes on, and the largest per-step loss difference between the two (the loss does not depend
on padding).

    uv run --frozen python benchmarks/sft_batch_length.py [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from _recipe_config import llama, recipe_config

from automodel.testing.ranks import run_on_ranks

SEQ = 1024
MODEL = llama(hidden=256, intermediate=688, layers=4, heads=4, kv_heads=2, max_positions=SEQ)
WORDS = "the a river city king song war year north school team book army game church music".split()


def write_rows(path: Path, *, n: int = 640) -> Path:
    """SQuAD-shaped rows: context, question, answer (a few words of the context)."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 60)))
        words = context.split()
        start = rng.randrange(len(words) - 3)
        question = "What comes after " + " ".join(words[max(0, start - 3) : start]) + "?"
        rows.append({"context": context, "question": question, "answer": " ".join(words[start : start + 3])})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def raw_config(tmp: str, *, steps: int) -> dict:
    raw = recipe_config(
        model=MODEL, seq_length=SEQ, max_bytes=1, local_batch=4, global_batch=8, steps=steps, fp32=True
    )
    raw["output_dir"] = f"{tmp}/out"
    raw["dataset"] = {
        "source": "instruction",
        "path_or_dataset_id": str(write_rows(Path(tmp) / "squad_shaped.jsonl")),
        "column_mapping": {"context": "context", "question": "question", "answer": "answer"},
        "answer_only_loss_mask": True,
        "seq_length": SEQ,
    }
    return raw


def measure(raw: dict, pad_multiple: int | None, warmup: int) -> dict[str, object]:
    import automodel.recipes.trainer as trainer_module
    from automodel.recipes import load_config

    if pad_multiple is not None:
        trainer_module.PAD_MULTIPLE = pad_multiple
    trainer = trainer_module.Trainer(load_config(raw))
    trainer.build()
    times, losses, lengths = [], [], []
    for step in range(trainer.total_steps):
        trainer.step = step
        batches = trainer.loader.next_step()
        lengths += [b.input_ids.numel() for b in batches]
        started = time.perf_counter()
        loss, _, _ = trainer.train_step(batches).fetch(step=step + 1)  # waits for the step
        losses.append(loss)
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return {"step_s": statistics.median(times), "losses": losses, "tokens": sum(lengths) / len(lengths)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        raw = raw_config(tmp, steps=a.steps)
        for name, multiple in (("seq_length", SEQ), ("longest", None)):
            results[name] = run_on_ranks(
                measure, world_size=2, args=(raw, multiple, a.warmup), timeout_s=1800
            )[0]
    print(
        f"fsdp2 dp=2, Llama hidden 256 x 4 layers, seq_length {SEQ}, local batch 4, global 8, fp32 AdamW; rank 0:"
    )
    for name, m in results.items():
        print(
            f"padded to {name:>10}: median step {m['step_s']:.3f} s, "
            f"{m['tokens']:.0f} tokens per micro-batch (incl. padding)"
        )
    diff = max(
        abs(x - y) for x, y in zip(results["longest"]["losses"], results["seq_length"]["losses"], strict=True)
    )
    print(
        f"step time longest / seq_length: {results['longest']['step_s'] / results['seq_length']['step_s']:.3f}"
    )
    print(f"largest per-step loss difference: {diff:.2e}")


if __name__ == "__main__":
    main()
