"""NeMo AutoModel's example recipes against this project: record their keys, or count how many load.

    git clone https://github.com/NVIDIA-NeMo/Automodel /tmp/Automodel   # not vendored here
    uv run --frozen python scripts/automodel_compat.py keys /tmp/Automodel > \\
        packages/recipes/tests/data/automodel_keys.json
    uv run --frozen python scripts/automodel_compat.py count /tmp/Automodel --model DIR [--verbose]

``keys`` writes the facts the compatibility test checks: every key path of the YAMLs under
``examples/llm_finetune`` and ``examples/llm_pretrain``, the number of files using it, the values
that occur (up to 16, long strings shortened) and, for dataset keys, the dataset classes used with
them. ``count`` loads each file unchanged except every ``pretrained_model_name_or_path``, which is
pointed at the local model directory ``--model``, and prints two counts: how many parse
(``load_config`` succeeds: `recipes validate` prints their plan) and how many of those run without
edits (no setting that `recipes train` and `recipes validate` refuse before launch on any machine,
``RecipeConfig.refusals``: a feature not implemented here, such as FP8 or a transformer-engine
kernel). Machine checks (``dist_env.backend: nccl`` needs CUDA) are not counted: the files target
GPU clusters. Then the files per refused key, and with ``--verbose`` each file's first error.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import warnings
from pathlib import Path
from typing import Any

MAX_VALUES = 16
MAX_CHARS = 120


def recipe_files(repo: Path) -> list[Path]:
    return sorted(
        p for d in ("llm_finetune", "llm_pretrain") for p in (repo / "examples" / d).rglob("*.yaml")
    )


def _leaves(node: Any, prefix: str = ""):
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            yield from _leaves(value, path)
        else:
            yield path, value


def _short(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_CHARS:
        return value[:MAX_CHARS] + "..."
    if isinstance(value, list):
        return [_short(v) for v in value]
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    return value


def record_keys(repo: Path) -> dict[str, Any]:
    from automodel.recipes.loader import load_yaml

    files = recipe_files(repo)
    counts: collections.Counter[str] = collections.Counter()
    values: dict[str, list[Any]] = collections.defaultdict(list)
    targets: dict[str, set[str]] = collections.defaultdict(set)
    for f in files:
        data = load_yaml(f.read_text())
        for path, value in _leaves(data):
            counts[path] += 1
            v = _short(value)
            if v not in values[path] and len(values[path]) < MAX_VALUES:
                values[path].append(v)
            section = path.split(".")[0]
            if section in ("dataset", "validation_dataset") and isinstance(data[section], dict):
                targets[path].add(str(data[section].get("_target_", "")).rsplit(".", 1)[-1])
    return {
        "source": "NVIDIA-NeMo/Automodel examples/llm_finetune and examples/llm_pretrain",
        "files": len(files),
        "keys": {
            p: {
                "files": counts[p],
                "values": values[p],
                **({"dataset_targets": sorted(targets[p])} if p in targets else {}),
            }
            for p in sorted(counts)
        },
    }


def point_at(node: Any, model_dir: str) -> Any:
    """Every ``pretrained_model_name_or_path`` (model, config, tokenizers) -> `model_dir`."""
    if isinstance(node, dict):
        return {
            k: model_dir
            if k == "pretrained_model_name_or_path" and isinstance(v, str)
            else point_at(v, model_dir)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [point_at(v, model_dir) for v in node]
    return node


def count(repo: Path, model_dir: str, *, verbose: bool) -> int:
    from automodel.recipes.api import load_config
    from automodel.recipes.errors import ConfigError
    from automodel.recipes.loader import load_yaml

    files = recipe_files(repo)
    loaded, refused, errors = 0, 0, collections.Counter()
    refused_keys: collections.Counter[str] = collections.Counter()
    lines = []
    for f in files:
        raw = point_at(load_yaml(f.read_text()), model_dir)
        raw.setdefault("output_dir", "/tmp/automodel_compat")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = load_config(raw)
        except ConfigError as e:
            errors[e.key] += 1
            lines.append(f"{f.relative_to(repo)}: {e}")
            continue
        loaded += 1
        if cfg.refusals:
            refused += 1
            refused_keys.update({_refused_key(e.key, e.value) for e in cfg.refusals})
            lines.append(f"{f.relative_to(repo)}: parses; refused before launch: {cfg.refusals[0]}")
    print(
        f"{loaded} of {len(files)} parse; {loaded - refused} of {len(files)} run without edits "
        f"({refused} parse and are refused before launch, naming the key)"
    )
    print("files refused when parsed, by key:")
    for key, n in errors.most_common():
        print(f"{n:4d} {key}")
    print("files refused before launch, by key:")
    for key, n in refused_keys.most_common():
        print(f"{n:4d} {key}")
    if verbose:
        print("\n".join(lines))
    return 0


def _refused_key(key: str, value: Any) -> str:
    """The key, with the value where it says which feature (``model.backend.attn: te``)."""
    return f"{key}: {value}" if key.startswith("model.backend.") and isinstance(value, str) else key


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("keys", "count"))
    p.add_argument("repo", type=Path, help="a checkout of NVIDIA-NeMo/Automodel")
    p.add_argument("--model", help="count: a local model directory (config.json)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.command == "keys":
        json.dump(record_keys(args.repo), sys.stdout, indent=1, sort_keys=False)
        print()
        return 0
    if not args.model:
        p.error("count needs --model DIR")
    return count(args.repo, args.model, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
