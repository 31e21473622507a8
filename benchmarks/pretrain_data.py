"""Pretraining data at scale: start-up and RSS vs corpus size, reader throughput, preprocess throughput.

1. Start-up time and RSS of one rank building a Megatron dataset (open, split, megatron-core's sample
   order, sampler, first step of its samples) on a 2 GiB and a 20 MiB corpus, each in a fresh
   process; ratios 2 GiB / 20 MiB. Twice: the order built in memory (no ``index_mapping_dir``), and
   mapped from ``index_mapping_dir`` where the first of the 3 runs wrote it.
2. Reader throughput: tokens per second one rank reads (random samples of seq_length + 1 through the
   sampler: index -> window -> int64 tensors), on one core, from the 2 GiB corpus.
3. `recipes preprocess` (our workers -> Megatron shards) vs `datasets.load_dataset("json") + .map(tokenizer,
   batched=True, num_proc=W)` on the same jsonl files, same tokenizer (a BPE trained here), same W,
   both single-threaded per worker (TOKENIZERS_PARALLELISM=false), whole commands (start-up
   included), no Arrow cache hit; one warm-up round of each, then `--rounds` alternating rounds,
   median.

    uv run --frozen python benchmarks/pretrain_data.py [--big-gib 2] [--work DIR] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SEQ = 2048


def write_random_corpus(prefix: Path, *, nbytes: int, seed: int = 0) -> None:
    """uint16 tokens in documents of 200..4000 tokens, written in chunks (Megatron layout)."""
    from automodel.data.megatron_index import write_index

    rng = np.random.default_rng(seed)
    total = nbytes // 2
    lengths = []
    with open(f"{prefix}.bin", "wb") as f:
        written = 0
        while written < total:
            n = min(1 << 24, total - written)
            f.write(rng.integers(1, 50000, n, dtype=np.uint16).tobytes())
            written += n
    left = total
    while left > 0:
        n = int(min(left, rng.integers(200, 4000)))
        lengths.append(n)
        left -= n
    write_index(
        f"{prefix}.idx",
        dtype=np.dtype(np.uint16),
        lengths=np.asarray(lengths),
        document_indices=np.arange(len(lengths) + 1),
    )


STARTUP_CHILD = r"""
import json, resource, sys, time
import torch  # the trainer's imports are paid before the data is touched
from automodel.data.batches import build_sampler
from automodel.data.pretrain_build import build_megatron
from automodel.data.pretrain_sections import MegatronPretrainingSection

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024

class Tok:
    vocab_size, eos_token_id = 50257, 0

before = rss()
t0 = time.perf_counter()
cache = sys.argv[3] if len(sys.argv) > 3 else None
section = MegatronPretrainingSection(
    paths=sys.argv[1], seq_length=int(sys.argv[2]), split="99,1,0", index_mapping_dir=cache
)
ds = build_megatron(section, Tok(), packed_sequence_size=0, seed=1234)
sampler = build_sampler(ds, global_batch_size=64, local_batch_size=8, dp_rank=1, dp_size=4, seed=1234)
batches = [ds.batch(ix) for ix in sampler.next_step()]
t1 = time.perf_counter()
print(json.dumps({"startup_s": t1 - t0, "rss_delta": rss() - before, "rss": rss(), "samples": len(ds)}))
"""


def startup(prefix: Path, *, cache: Path | None = None) -> dict:
    """Best of 3 fresh processes. With `cache` (``index_mapping_dir``) the first run builds megatron-core's
    order there and the others map it; without, every run builds it in memory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = []
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", STARTUP_CHILD, str(prefix), str(SEQ), *([str(cache)] if cache else [])],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda r: r["startup_s"])
    best["rss"] = min(r["rss"] for r in runs)
    best["rss_delta"] = min(r["rss_delta"] for r in runs)
    return best


def reader_throughput(prefix: Path, *, seconds: float = 5.0) -> float:
    """Tokens/s of one rank reading its samples (dp 1 of 1, local batch 8, global 64)."""
    import torch

    from automodel.data.batches import build_sampler
    from automodel.data.pretrain_build import build_megatron
    from automodel.data.pretrain_sections import MegatronPretrainingSection

    torch.set_num_threads(1)

    class Tok:
        vocab_size, eos_token_id = 50257, 0

    section = MegatronPretrainingSection(paths=str(prefix), seq_length=SEQ, split="99,1,0")
    ds = build_megatron(section, Tok(), packed_sequence_size=0, seed=1234)
    sampler = build_sampler(ds, global_batch_size=64, local_batch_size=8, dp_rank=0, dp_size=1, seed=1234)
    tokens = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for ix in sampler.next_step():
            ids, _, _ = ds.batch(ix)
            tokens += ids.numel() + ids.shape[0]
    return tokens / (time.perf_counter() - t0)


def text_corpus(folder: Path, *, files: int, mb_per_file: float) -> None:
    """jsonl files of English-like text from the stdlib's docstrings and comments (what ships)."""
    from automodel.recipes.data import embedded_documents

    pool = embedded_documents(max_bytes=8_000_000)
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        with open(folder / f"part_{i:03d}.jsonl", "w") as f:
            size = 0
            while size < mb_per_file * 1e6:
                doc = pool[int(rng.integers(len(pool)))]
                a = int(rng.integers(max(1, len(doc) - 3000)))
                line = json.dumps({"text": doc[a : a + int(rng.integers(500, 3000))]}) + "\n"
                f.write(line)
                size += len(line)


def train_bpe(folder: Path, out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<unk>", "<|endoftext|>"])
    sample = [json.loads(line)["text"] for line in open(next(folder.glob("*.jsonl")))][:2000]
    tok.train_from_iterator(sample, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>"
    ).save_pretrained(out)


def preprocess_vs_datasets_map(work: Path, *, workers: int, mb: float, rounds: int = 5) -> dict:
    folder, tokdir = work / "text", work / "bpe"
    shutil.rmtree(folder, ignore_errors=True)
    text_corpus(folder, files=2 * workers, mb_per_file=mb / (2 * workers))
    train_bpe(folder, tokdir)
    nbytes = sum(p.stat().st_size for p in folder.glob("*.jsonl"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(work / "hf_cache")}
    ours_cmd = [
        str(Path(sys.executable).with_name("recipes")), "preprocess", str(folder), "--output", str(work / "shards"),
        "--tokenizer", str(tokdir), "--workers", str(workers), "--shard-size-mb", str(mb / (2 * workers)), "--no-progress",
    ]  # fmt: skip
    theirs = (
        "import datasets, sys, time\n"
        "from transformers import AutoTokenizer\n"
        f"tok = AutoTokenizer.from_pretrained({str(tokdir)!r})\n"
        f"files = sorted(str(p) for p in __import__('pathlib').Path({str(folder)!r}).glob('*.jsonl'))\n"
        "ds = datasets.load_dataset('json', data_files=files, split='train')\n"
        "out = ds.map(lambda b: tok(b['text'], add_special_tokens=False), batched=True, "
        f"num_proc={workers}, remove_columns=['text'])\n"
        "print(sum(len(x) for x in out['input_ids']))\n"
    )
    times: dict[str, list[float]] = {"preprocess": [], "datasets_map": []}
    for r in range(rounds + 1):  # round 0 warms the page cache and bytecode; not counted
        for name, cmd in (("preprocess", ours_cmd), ("datasets_map", [sys.executable, "-c", theirs])):
            shutil.rmtree(work / "shards", ignore_errors=True)
            shutil.rmtree(work / "hf_cache", ignore_errors=True)  # no Arrow cache hit for datasets
            t0 = time.perf_counter()
            subprocess.run(
                cmd, check=True, env={**env, "TOKENIZERS_PARALLELISM": "false"}, capture_output=True
            )
            if r:
                times[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(t)) for name, t in times.items()}
    return {
        "input_mb": nbytes / 1e6,
        "rounds": rounds,
        **{f"{name}_median_s": m for name, m in med.items()},
        "all_s": {name: [round(x, 2) for x in t] for name, t in times.items()},
        "speedup_median": med["datasets_map"] / med["preprocess"],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--big-gib", type=float, default=2.0)
    p.add_argument("--work", default=None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--text-mb", type=float, default=20.0, help="jsonl input of the preprocess comparison")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of the preprocess comparison (median)")
    p.add_argument("--skip", nargs="*", default=[], choices=["startup", "reader", "preprocess"])
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="pretrain_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    small, big = work / "small_text_document", work / "big_text_document"
    results: dict = {}
    if not {"startup", "reader"} <= set(args.skip):
        write_random_corpus(small, nbytes=20 << 20)
        t0 = time.perf_counter()
        write_random_corpus(big, nbytes=int(args.big_gib * (1 << 30)))
        print(f"wrote {args.big_gib} GiB corpus in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if "startup" not in args.skip:
        for name, cache in (("built", None), ("cached", work / "index_mapping")):
            s = startup(small, cache=cache)
            b = startup(big, cache=cache)
            results[f"startup_{name}"] = {
                "small": s,
                "big": b,
                "time_ratio": b["startup_s"] / s["startup_s"],
                "rss_ratio": b["rss"] / s["rss"],
                "rss_delta_ratio": b["rss_delta"] / s["rss_delta"],
            }
    if "reader" not in args.skip:
        results["reader_tokens_per_s"] = reader_throughput(big)
    if "preprocess" not in args.skip:
        results["preprocess"] = preprocess_vs_datasets_map(
            work, workers=args.workers, mb=args.text_mb, rounds=args.rounds
        )
    print(json.dumps(results, indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
