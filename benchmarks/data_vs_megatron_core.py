"""automodel-data's Megatron reader vs megatron-core's `GPTDataset`, on the same corpus, in one run.

1. Samples per second: the same sample indices (the training order of 64-sample global batches, dp 1)
   read as token tensors by our dataset (`batch(indices)`: seq_length + 1 tokens per sample, int64)
   and by megatron-core's ``GPTDataset`` built by its own ``BlendedMegatronDatasetBuilder``
   (``dataset[i]``: tokens, labels, loss mask, position ids, attention mask off), one core each
   (``torch.set_num_threads(1)``), alternating rounds, median. The samples are checked equal first.
2. Start-up on a 2 GiB corpus (written to a temporary folder, deleted at the end): a fresh process
   per measurement, from the section to the first global batch (imports excluded), first with the
   order built (ours into ``index_mapping_dir``, megatron-core's into its ``path_to_cache``), then
   mapped from that cache; best of 3 each.

    uv run --frozen python benchmarks/data_vs_megatron_core.py [--gib 2] [--seq 2048] [--rounds 5]
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
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from pretrain_data import write_random_corpus  # noqa: E402

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
which, prefix, seq, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
n = int(sys.argv[5]) if len(sys.argv) > 5 else 0
if which == "ours":
    from automodel.data import MegatronPretrainingSection, Vocab, build_dataset, build_loader
else:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

class MTok:  # what GPTDatasetConfig reads of a tokenizer
    eod, pad, vocab_size, unique_identifiers = 0, -1, 50257, {"class": "bench"}

def build():
    if which == "ours":
        section = MegatronPretrainingSection(paths=prefix, seq_length=seq, split="100,0,0", seed=1234,
                                             index_mapping_dir=cache)
        ds = build_dataset(section, tokenizer=Vocab(vocab_size=50257, eos_token_id=0))
        loader = build_loader(ds, global_batch_size=64, local_batch_size=64, dp_rank=0, dp_size=1, seed=1234)
        return ds, loader.sampler
    cfg = GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend=([prefix], None), split="100,0,0",
                           tokenizer=MTok(), reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, path_to_cache=cache, create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, cfg).build()[0], None

t0 = time.perf_counter()
ds, sampler = build()
if which == "ours":
    first = [ds.batch(ix) for ix in sampler.next_step()]
else:
    first = [ds[i] for i in range(64)]
out = {"startup_s": time.perf_counter() - t0, "samples": len(ds)}
if n:  # throughput: the same n indices, in our sampler's training order
    from automodel.data import MegatronPretrainingSection as S, Vocab as V, build_dataset as B, build_loader as L
    ours = B(S(paths=prefix, seq_length=seq, split="100,0,0", seed=1234, index_mapping_dir=cache), tokenizer=V(vocab_size=50257, eos_token_id=0))
    order = L(ours, global_batch_size=64, local_batch_size=64, dp_rank=0, dp_size=1, seed=1234).sampler
    steps = [order.next_step()[0] for _ in range(n // 64)]
    t0 = time.perf_counter()
    if which == "ours":
        for ix in steps:
            ds.batch(ix)
    else:
        for ix in steps:
            for i in ix:
                ds[i]
    out["samples_per_s"] = n / (time.perf_counter() - t0)
print(json.dumps(out))
"""

CHECK = r"""
import sys
import torch
from automodel.data import MegatronPretrainingSection, Vocab, build_dataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
prefix, seq, ours_cache, their_cache = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
class MTok:
    eod, pad, vocab_size, unique_identifiers = 0, -1, 50257, {"class": "bench"}
ours = build_dataset(MegatronPretrainingSection(paths=prefix, seq_length=seq, split="100,0,0", seed=1234,
                     index_mapping_dir=ours_cache), tokenizer=Vocab(vocab_size=50257, eos_token_id=0))
cfg = GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend=([prefix], None), split="100,0,0",
                       tokenizer=MTok(), reset_position_ids=False, reset_attention_mask=False,
                       eod_mask_loss=False, path_to_cache=their_cache, create_attention_mask=False)
theirs = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, cfg).build()[0]
assert len(ours) == len(theirs), (len(ours), len(theirs))
for i in list(range(0, len(ours), max(1, len(ours) // 200))) + [len(ours) - 1]:
    t = theirs[i]
    assert ours.sample(i).tolist() == t["tokens"].tolist() + t["labels"][-1:].tolist(), i
print(len(ours))
"""


def child(which: str, prefix: Path, seq: int, cache: Path, n: int = 0) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", CHILD, which, str(prefix), str(seq), str(cache), *([str(n)] if n else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"{which} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=64 * 40)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="data_vs_mcore-"))
    try:
        prefix = work / "corpus"
        t0 = time.perf_counter()
        write_random_corpus(prefix, nbytes=int(args.gib * (1 << 30)))
        size = Path(f"{prefix}.bin").stat().st_size
        print(f"corpus: {size / (1 << 30):.2f} GiB written in {time.perf_counter() - t0:.1f} s", flush=True)
        caches = {"ours": work / "ours_cache", "megatron-core": work / "mcore_cache"}
        startup: dict[str, dict[str, float]] = {}
        for which, cache in caches.items():  # first run builds the order into the cache, then mapped
            key = "ours" if which == "ours" else "theirs"
            built = child(key, prefix, args.seq, cache)
            mapped = min(
                (child(key, prefix, args.seq, cache) for _ in range(3)), key=lambda r: r["startup_s"]
            )
            startup[which] = {
                "built_s": built["startup_s"],
                "mapped_s": mapped["startup_s"],
                "samples": built["samples"],
            }
            print(f"start-up {which}: order built {built['startup_s']:.3f} s, mapped {mapped['startup_s']:.3f} s "
                  f"({built['samples']} samples)", flush=True)  # fmt: skip
        checked = subprocess.run(
            [sys.executable, "-c", CHECK, str(prefix), str(args.seq), str(caches["ours"]), str(caches["megatron-core"])],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        print(
            f"samples equal to megatron-core's (every {max(1, int(checked) // 200)}th of {checked})",
            flush=True,
        )
        rates: dict[str, list[float]] = {"ours": [], "megatron-core": []}
        for _ in range(args.rounds):
            for which, cache in caches.items():
                key = "ours" if which == "ours" else "theirs"
                rates[which].append(child(key, prefix, args.seq, cache, args.samples)["samples_per_s"])
        med = {k: float(np.median(v)) for k, v in rates.items()}
        print(
            f"samples/s (seq {args.seq}, {args.samples} samples, median of {args.rounds}): ours {med['ours']:.0f}, "
            f"megatron-core {med['megatron-core']:.0f} (x{med['ours'] / med['megatron-core']:.2f})"
        )
        print(json.dumps({"corpus_gib": size / (1 << 30), "startup": startup, "samples_per_s": med,
                          "rounds": rates}))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
