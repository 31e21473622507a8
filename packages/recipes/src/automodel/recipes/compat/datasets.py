"""NeMo AutoModel's SQuAD and HellaSwag dataset factories as dataset kinds, reading the datasets'
own nested columns, so a Hub snapshot (or local files with the same columns) needs no conversion.

- ``make_squad_dataset`` (kind ``squad``): ``context``, ``question``, ``answers.text[0]``; the prompt
  ``"Context: {context} Question: {question} Answer: "`` (as a user turn with a chat template),
  the answer the label.
- ``HellaSwag`` (kind ``hellaswag``): ``ctx`` as the prompt, ``endings[int(label)]`` the label.

Both then go through the SFT pipeline (`data.sft`): rows of at most ``seq_length`` tokens, answer-only
loss, packing with ``packed_sequence``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel.data.hub_cache import resolve_local_or_cached
from automodel.data.quiet_datasets import no_progress_bars
from automodel.data.sft import _load_table, build_sft_dataset, count_sft_rows
from automodel.recipes.config.hub_datasets import HellaSwagSection, SquadSection
from automodel.recipes.errors import ConfigError


def _column(section: SquadSection | HellaSwagSection, ds: Any, name: str) -> list[Any]:
    if name not in ds.column_names:
        raise ConfigError(
            f"{section.SECTION}.{section.PATH_KEY}",
            section.path_or_dataset_id,
            f"has no {name!r} column (columns: {', '.join(ds.column_names)}); is it {section.source}?",
        )
    return ds[name]


def squad_records(section: SquadSection, ds: Any) -> list[dict[str, str]]:
    """SQuAD rows -> (prompt, answer): the first of ``answers.text`` (stripped), as AutoModel."""
    contexts, questions, answers = (_column(section, ds, c) for c in ("context", "question", "answers"))
    out = []
    for context, question, answer in zip(contexts, questions, answers, strict=True):
        texts = answer.get("text") if isinstance(answer, dict) else None
        out.append(
            {
                "prompt": f"Context: {context} Question: {question} Answer: ",
                "answer": texts[0].strip() if texts else "",
            }
        )
    return out


def hellaswag_records(section: HellaSwagSection, ds: Any) -> list[dict[str, str]]:
    """HellaSwag rows -> (prompt, answer): ``ctx`` and ``endings[int(label)]``, as AutoModel."""
    ctxs, endings, labels = (_column(section, ds, c) for c in ("ctx", "endings", "label"))
    out = []
    for ctx, options, label in zip(ctxs, endings, labels, strict=True):
        try:
            answer = options[int(label)]
        except (ValueError, TypeError, IndexError):
            answer = ""  # an unlabeled row (HellaSwag's test split): skipped as "empty answer"
        out.append({"prompt": ctx, "answer": answer})
    return out


def build_squad(section: SquadSection, tokenizer: Any, *, packed_sequence_size: int, seed: int) -> Any:
    return _build(section, tokenizer, packed_sequence_size=packed_sequence_size, records=squad_records)


def build_hellaswag(
    section: HellaSwagSection, tokenizer: Any, *, packed_sequence_size: int, seed: int
) -> Any:
    return _build(section, tokenizer, packed_sequence_size=packed_sequence_size, records=hellaswag_records)


def _build(
    section: SquadSection | HellaSwagSection, tokenizer: Any, *, packed_sequence_size: int, records: Any
) -> Any:
    rows = records(section, _load_table(section))
    return build_sft_dataset(section, tokenizer, packed_sequence_size=packed_sequence_size, records=rows)


def count_squad(
    section: SquadSection, tokenizer: Any, *, packed_sequence_size: int, seed: int, at_least: int
) -> int:
    """`build_squad`'s rows, counted before launch (`data.sft.count_sft_rows`)."""
    return _count(section, tokenizer, packed_sequence_size, at_least, squad_records)


def count_hellaswag(
    section: HellaSwagSection, tokenizer: Any, *, packed_sequence_size: int, seed: int, at_least: int
) -> int:
    """`build_hellaswag`'s rows, counted before launch (`data.sft.count_sft_rows`)."""
    return _count(section, tokenizer, packed_sequence_size, at_least, hellaswag_records)


def _count(
    section: SquadSection | HellaSwagSection,
    tokenizer: Any,
    packed_sequence_size: int,
    at_least: int,
    records: Any,
) -> int:
    with no_progress_bars():
        rows = records(section, _load_table(section))
    return count_sft_rows(
        section, tokenizer, packed_sequence_size=packed_sequence_size, at_least=at_least, records=rows
    )


def check_paths(section: SquadSection | HellaSwagSection) -> None:
    """Local files must exist; anything else must be a directory or a Hub id in the local cache."""
    src = section.path_or_dataset_id
    key = f"{section.SECTION}.{section.PATH_KEY}"
    for p in src if isinstance(src, list) else []:
        if not Path(p).expanduser().is_file():
            raise ConfigError(key, p, "does not exist (only local files are read from a list)")
    if isinstance(src, str) and not Path(src).expanduser().exists():
        resolve_local_or_cached(src, key=key, repo_type="dataset")
