"""`recipes preprocess`: text corpora -> Megatron ``.bin``/``.idx`` shards with the run's tokenizer.

Each task of `preprocess_inputs.plan_tasks` becomes ``<output>/shard_NNNNN.bin/.idx`` in a worker
process (EOS after every document, BOS before it when the tokenizer adds one, tokens in the
smallest integer dtype that holds the vocabulary). ``<output>/manifest.json`` records the
tokenizer, the counts and the SHA-256 of every shard, rewritten after each shard; a restarted run
skips the shards the manifest lists for the same input bytes, so an interrupted run loses at most
the shards in progress. Train on the folder with ``dataset: {source: megatron, paths: <output>}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

from automodel.data.errors import ConfigError, optional
from automodel.data.megatron_writer import token_dtype_for_vocab
from automodel.data.preprocess_inputs import Task, input_files, plan_tasks
from automodel.data.preprocess_worker import TokenizerSpec, adopt_tokenizer, init_worker, run_task
from automodel.data.tokenizer import TOKENIZER_FILES, bos_prefix, build_tokenizer

MANIFEST = "manifest.json"


def tokenizer_identity(tok: Any, path: str | None, *, prepend_bos: bool) -> dict:
    """What makes shards of two runs compatible: the tokenizer's files, ids and special tokens."""
    files = {}
    if path is not None:
        for name in TOKENIZER_FILES + ("merges.txt", "special_tokens_map.json"):
            f = Path(path) / name
            if f.is_file():
                files[name] = hashlib.sha256(f.read_bytes()).hexdigest()
    return {
        "path": path if path is not None else "byte-level (automodel ByteTokenizer)",
        "vocab_size": tok.vocab_size,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "prepend_bos": prepend_bos,
        "files_sha256": files,
    }


def _write_manifest(out: Path, manifest: dict) -> None:
    shards = [s for s in manifest["shards"].values()]
    manifest["totals"] = {
        "shards": sum(1 for s in shards if s["documents"]),
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "skipped_empty": sum(s["skipped_empty"] for s in shards),
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, out / MANIFEST)


def _finished(out: Path, manifest: dict, task: Task) -> bool:
    entry = manifest["shards"].get(task.name)
    if entry is None or entry["input"] != task.key():
        return False
    if entry["documents"] == 0:
        return True
    b = out / f"{task.name}.bin"
    return b.is_file() and (out / f"{task.name}.idx").is_file() and b.stat().st_size == entry["bin_bytes"]


def preprocess(
    *,
    inputs: list[str],
    output_dir: str,
    text_key: str = "text",
    tokenizer_path: str | None = None,
    trust_remote_code: bool = False,
    workers: int = 1,
    shard_bytes: int = 128 << 20,
    progress: bool = True,
) -> dict:
    """Tokenize `inputs` into Megatron shards under `output_dir`; returns the manifest."""
    if workers < 1:
        raise ConfigError("--workers", workers, "must be >= 1")
    if shard_bytes < 1:
        raise ConfigError("--shard-size-mb", shard_bytes, "must be > 0")
    tok = build_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
    spec = TokenizerSpec(
        path=tokenizer_path, trust_remote_code=trust_remote_code, prepend_bos=bool(bos_prefix(tok))
    )
    dtype = token_dtype_for_vocab(tok.vocab_size)
    tasks = plan_tasks(input_files(inputs), shard_bytes=shard_bytes)
    if not tasks:
        raise ConfigError("preprocess input", inputs, "holds no data (empty files)")
    out = Path(output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    header = {
        "format": "megatron-indexed (MMIDIDX v1), one sequence per document",
        "tokenizer": tokenizer_identity(tok, tokenizer_path, prepend_bos=spec.prepend_bos),
        "dtype": dtype.name,
        "text_key": text_key,
        "shard_bytes": shard_bytes,
    }
    manifest: dict = {**header, "shards": {}}
    if (out / MANIFEST).is_file():
        old = json.loads((out / MANIFEST).read_text())
        for key, value in header.items():
            if old.get(key) != value:
                raise ConfigError(
                    "--output",
                    str(out),
                    f"holds shards made with another {key} ({old.get(key)!r}); use a new folder",
                )
        manifest["shards"] = {
            n: e for n, e in old.get("shards", {}).items() if int(n.split("_")[1]) < len(tasks)
        }
    pending = [t for t in tasks if not _finished(out, manifest, t)]
    for t in pending:
        manifest["shards"].pop(t.name, None)
    for stale in sorted(out.glob("shard_*.bin")) + sorted(out.glob("shard_*.idx")):
        if int(stale.stem.split("_")[1]) >= len(tasks):
            stale.unlink()
    _write_manifest(out, manifest)
    work = partial(run_task, out_dir=str(out), text_key=text_key, dtype=dtype.name, spec=spec)
    bar = None
    if progress:
        bar = optional("tqdm", needed_for="preprocess's progress bar").tqdm(
            total=sum(t.nbytes for t in pending),
            unit="B",
            unit_scale=True,
            desc="preprocess",
            dynamic_ncols=True,
        )
    docs = tokens = 0
    started = time.perf_counter()
    by_name = {t.name: t for t in pending}
    with contextlib.ExitStack() as stack:
        if bar is not None:
            stack.callback(bar.close)
        adopt_tokenizer(spec, tok)  # forked workers inherit it: none loads its own
        if workers == 1 or len(pending) <= 1:
            init_worker(spec)
            results: Any = map(work, pending)
        else:
            ctx = multiprocessing.get_context("fork")
            pool = stack.enter_context(ctx.Pool(min(workers, len(pending)), init_worker, (spec,)))
            results = pool.imap_unordered(work, pending)
        for entry in results:
            manifest["shards"][entry["name"]] = entry
            _write_manifest(out, manifest)
            docs, tokens = docs + entry["documents"], tokens + entry["tokens"]
            if bar is not None:
                bar.update(by_name[entry["name"]].nbytes)
                bar.set_postfix(docs=docs, tokens=tokens, refresh=False)
    manifest["last_run"] = {
        "shards_written": len(pending),
        "shards_skipped": len(tasks) - len(pending),
        "seconds": round(time.perf_counter() - started, 3),
        "input_bytes": sum(t.nbytes for t in pending),
    }
    _write_manifest(out, manifest)
    if manifest["totals"]["documents"] == 0:
        raise ConfigError("preprocess input", inputs, f"holds no non-empty {text_key!r} text")
    return manifest
