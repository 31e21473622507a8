"""NeMo AutoModel's ``MegatronPretraining.paths`` and ``split``, resolved to corpora and document ranges.

``paths`` is one of (as in AutoModel):
- a prefix (``data/corpus_text_document``), a ``.bin``/``.idx`` file, a glob over them, or a folder
  (every ``*.idx`` in it);
- a list of those, or Megatron's zipped blend ``["30", "prefix_a", "70", "prefix_b"]``;
- a mapping ``{train: ..., validation: ..., test: ...}`` (aliases valid/val/dev) of such lists, one
  distribution per split (``split`` is then not used);
- a ``.json`` file holding a list or a mapping of the above.

``split`` (``"99,1,0"`` or ``"0.99, 0.01, 0.00"``) divides each corpus by sequence (document)
index, as megatron-core's GPT dataset does: split ``i`` gets ``[round(b_i * n), round(e_i * n))``.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

from automodel.data.errors import ConfigError
from automodel.data.megatron_corpus import corpus_prefix

SPLITS = ("train", "validation", "test")
SPLIT_ALIASES = {"valid": "validation", "val": "validation", "dev": "validation"}


def split_range(num_sequences: int, ratios: list[float], split_name: str) -> tuple[int, int]:
    """Sequence range ``[begin, end)`` of `split_name` in a corpus of `num_sequences` (Megatron's rounding)."""
    i = SPLITS.index(split_name)
    lo = sum(ratios[:i])
    hi = lo + ratios[i]
    return int(round(lo * num_sequences)), int(round(hi * num_sequences))


def _is_number(s: Any) -> bool:
    if isinstance(s, bool):
        return False
    try:
        float(s)
    except (TypeError, ValueError):
        return False
    return True


def expand_prefixes(entry: str, *, key: str) -> list[str]:
    """A prefix, ``.bin``/``.idx`` file, glob or folder -> sorted corpus prefixes (existence checked)."""
    p = Path(entry).expanduser()
    prefix = corpus_prefix(str(p))
    if Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file():
        return [prefix]
    if p.is_dir():
        found = sorted({corpus_prefix(f) for f in glob.glob(str(p / "*.idx"))})
        if not found:
            raise ConfigError(key, entry, "is a folder with no Megatron .idx files")
        return found
    if glob.has_magic(str(p)):
        matched = glob.glob(str(p))
        found = sorted({corpus_prefix(f) for f in matched if f.endswith((".bin", ".idx"))})
        if not found:
            raise ConfigError(key, entry, "matches no .bin/.idx files")
        return found
    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise ConfigError(
                key, entry, f"{prefix}{suffix} does not exist (a corpus is <prefix>.bin + .idx)"
            )
    return [prefix]


def resolve_blend(paths: Any, *, split_name: str, key: str) -> tuple[list[str], list[float] | None, bool]:
    """(prefixes, weights or None, whether `split` divides them) for `split_name` of ``paths``."""
    if isinstance(paths, str) and paths.lower().endswith(".json"):
        try:
            paths = json.loads(Path(paths).expanduser().read_text())
        except FileNotFoundError:
            raise ConfigError(key, paths, "blend file does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(key, paths, f"is not valid JSON ({e.msg} at line {e.lineno})") from None
    uses_split = True
    if isinstance(paths, dict):
        by_split = {SPLIT_ALIASES.get(k, k): v for k, v in paths.items()}
        unknown = set(by_split) - set(SPLITS)
        if unknown:
            raise ConfigError(f"{key}.{sorted(unknown)[0]}", None, "is not a split (train, validation, test)")
        if by_split.get(split_name) is None:
            raise ConfigError(key, sorted(paths), f"has no {split_name!r} entry")
        paths, uses_split = by_split[split_name], False
    entries = [paths] if isinstance(paths, str) else paths
    if (
        not isinstance(entries, list)
        or not entries
        or not all(isinstance(e, str | int | float) for e in entries)
    ):
        raise ConfigError(
            key, paths, "must be a path, a list of paths, or a zipped list of weights and paths"
        )
    entries = [str(e) for e in entries]
    weights: list[float] | None = None
    if len(entries) % 2 == 0 and all(_is_number(e) for e in entries[::2]):
        weights = [float(w) for w in entries[::2]]
        entries = entries[1::2]
        for w, e in zip(weights, entries):
            if not w > 0:
                raise ConfigError(key, f"{w:g} for {e}", "blend weights must be > 0")
    prefixes: list[str] = []
    expanded_weights: list[float] = []
    for i, entry in enumerate(entries):
        found = expand_prefixes(entry, key=key)
        if weights is not None and len(found) > 1:
            raise ConfigError(
                key, entry, f"has weight {weights[i]:g} but names {len(found)} corpora; give each its own"
            )
        prefixes += found
        if weights is not None:
            expanded_weights.append(weights[i])
    return prefixes, (expanded_weights if weights is not None else None), uses_split
