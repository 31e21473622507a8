"""Supervised fine-tuning data: examples -> (tokens, answer mask) -> padded or packed rows.

An example is a prompt and an answer: ``context`` / ``question`` / ``answer`` columns (mapped with
``column_mapping``), or a ``messages`` conversation in the OpenAI chat format. It is rendered with
the tokenizer's chat template when it has one (``use_hf_chat_template``), else as plain text
``format_plain_prompt(context, question) + answer + EOS``.

With ``answer_only_loss_mask`` only answer tokens are labels: in a chat template these are the
characters an assistant turn adds to the conversation (the rendering of ``messages[:i]`` is a prefix
of the rendering of ``messages[:i+1]``; the rest, the turn's role header, answer and end-of-turn
marker, is labelled, as NeMo AutoModel 0.7 does; with ``mask_generation_prompt`` the prefix is
rendered with the generation prompt, so the role header is not), mapped to tokens through the
tokenizer's offsets. Padding is
never a label. Labels are the next tokens (``labels[t] = ids[t+1]`` or -100), shifted inside
each example, so packed examples never predict across a document boundary.

Rows: one example per row of at most ``seq_length`` tokens, or (``packed_sequence``) several whole
examples per row of ``packed_sequence_size`` tokens whose position ids restart at 0 at each
example: transformers builds a block-causal mask from them (attention never crosses examples) and
context parallelism reads the same boundaries (``cu_seqlens`` from the restarts). A micro-batch
of one-example rows is as long as its longest example rounded up to a small multiple
(`BatchLength`, applied by `batch_length_rows`), not ``seq_length``: padding carries no label and
comes after every real token, so under causal attention the loss does not depend on it.

Bad rows are skipped and counted (rank 0 prints the counts): an empty answer, no prompt, a
conversation without an assistant turn, an example longer than a row (unless ``truncation``). A
missing column or a template that cannot be split into turns is a `ConfigError`. A bad row of a
local JSON file (not UTF-8, malformed, not an object, a wrong type) stops the run naming its file
and line, or with ``bad_rows: skip`` is skipped and counted like these (`file_check`).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from automodel.data.errors import ConfigError, DataError, optional
from automodel.data.file_check import read_good_rows, section_columns
from automodel.data.hub_cache import resolve_local_or_cached
from automodel.data.quiet_datasets import no_progress_bars
from automodel.data.sections import ExampleSection
from automodel.data.stdlib_docstrings import stdlib_docstring_examples
from automodel.data.table_rows import read_csv_rows, split_data_files
from automodel.data.tokenizer import bos_prefix

IGNORE_INDEX = -100
_EXTENSION_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def format_plain_prompt(*, context: str | None, question: str | None) -> str:
    """The prompt of an example without a chat template: its non-empty parts, one per line."""
    return "".join(f"{part}\n" for part in (context, question) if part)


@dataclass
class Example:
    """Token ids and, per token, whether it is a label (predicted from the tokens before it)."""

    ids: list[int]
    label_mask: list[bool]


class SkippedExample(Exception):
    """This example is left out; the message is the counted reason."""


# ---- encoding --------------------------------------------------------------------------------
def encode_plain(tokenizer: Any, *, prompt: str, answer: str, answer_only: bool, bos: list[int]) -> Example:
    """``bos + prompt + answer + EOS``; the answer and its EOS are the labels."""
    p = list(bos) + tokenizer.encode(prompt)
    a = tokenizer.encode(answer) + [tokenizer.eos_token_id]
    return Example(ids=p + a, label_mask=[not answer_only] * len(p) + [True] * len(a))


def _render(hf: Any, messages: list[dict], *, generation_prompt: bool, tools: Any = None) -> str:
    """The chat template's text; a row the template refuses (``raise_exception``: roles that do not
    alternate under a Llama-2/Mistral-style template) is skipped and counted, not fatal. A template
    that cannot be parsed at all is a config error and still raises."""
    kwargs = {"tools": tools} if tools else {}
    jinja = optional("jinja2.exceptions", needed_for="a chat template")
    try:
        return hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )
    except jinja.TemplateSyntaxError:
        raise
    except jinja.TemplateError as e:
        raise SkippedExample(f"refused by the chat template ({e.message or e})") from None


def encode_chat(
    tokenizer: Any,
    messages: list[dict],
    *,
    answer_only: bool,
    key: str,
    tools: Any = None,
    mask_generation_prompt: bool = False,
) -> Example:
    """Render `messages` with the chat template; every assistant turn's rendered characters are labels.

    As NeMo AutoModel 0.7's ``format_chat_template``: a turn is what the template adds for it (its
    role header, content and end-of-turn marker); with `mask_generation_prompt` the part the template's
    generation prompt writes (the role header) is not labelled, the turn's content and marker are.
    """
    hf = tokenizer.hf
    full = _render(hf, messages, generation_prompt=False, tools=tools)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(hf, messages[:i], generation_prompt=mask_generation_prompt, tools=tools) if i else ""
        upto = _render(hf, messages[: i + 1], generation_prompt=False, tools=tools)
        if not upto.startswith(before) or not full.startswith(upto):
            raise ConfigError(
                key,
                True,
                "the chat template does not render a conversation turn by turn (the conversation up to "
                f"assistant turn {i} is not a prefix of the whole), so answer tokens cannot be located; "
                "set use_hf_chat_template: false or give a chat_template",
            )
        if len(upto) > len(before):
            spans.append((len(before), len(upto)))
    if not getattr(hf, "is_fast", False):
        raise ConfigError(key, True, "answer masks from a chat template need a fast (tokenizers) tokenizer")
    enc = hf(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if not answer_only:
        return Example(ids=ids, label_mask=[True] * len(ids))
    mask = []
    for start, end in enc["offset_mapping"]:
        mask.append(end > start and any(a <= start < b for a, b in spans))
    return Example(ids=ids, label_mask=mask)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise SkippedExample("a value that is not text")
    return value


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise SkippedExample("messages not a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise SkippedExample("a message without a role")
        out.append({k: v for k, v in m.items() if v is not None})
    answers = [m for m in out if m["role"] == "assistant"]
    if not answers:
        raise SkippedExample("no assistant turn")
    if any(not (m.get("content") or m.get("tool_calls")) for m in answers):
        raise SkippedExample("empty answer")
    return out


class ExampleEncoder:
    """Turns one record (role -> value) of a section into an `Example`, or raises `SkippedExample`."""

    def __init__(self, section: ExampleSection, tokenizer: Any) -> None:
        s = section.SECTION
        self.section = section
        self.tokenizer = tokenizer
        self.key = f"{s}.use_hf_chat_template"
        # AutoModel's ChatDataset key; the sections without it (SQuAD, HellaSwag) take its default
        self.mask_generation_prompt = bool(getattr(section, "mask_generation_prompt", False))
        if section.chat_template is not None:
            if tokenizer.hf is None:
                raise ConfigError(
                    f"{s}.chat_template",
                    "...",
                    "needs a Hugging Face tokenizer (the byte tokenizer has none)",
                )
            # saved with the tokenizer in checkpoints
            tokenizer.hf.chat_template = read_chat_template(f"{s}.chat_template", section.chat_template)
        has_template = tokenizer.chat_template is not None
        use = section.use_hf_chat_template
        need = "needs a tokenizer with a chat template (this one has none); give a chat_template or a tokenizer that has one"
        if section.source == "chat":
            if use is False:
                raise ConfigError(self.key, False, "source chat renders conversations with the chat template")
            if not has_template:
                raise ConfigError(f"{s}.source", "chat", need)
            self.use_template = True
        else:
            if use is True and not has_template:
                raise ConfigError(self.key, True, need)
            self.use_template = has_template if use is None else use
        self.bos = [] if self.use_template else bos_prefix(tokenizer)

    def _chat(self, messages: list[dict[str, Any]], *, answer_only: bool, tools: Any = None) -> Example:
        """`messages` rendered with the chat template, labelled as this section asks."""
        return encode_chat(
            self.tokenizer,
            messages,
            answer_only=answer_only,
            key=self.key,
            tools=tools,
            mask_generation_prompt=self.mask_generation_prompt,
        )

    def __call__(self, record: dict[str, Any]) -> Example:
        answer_only = self.section.answer_only_loss_mask
        if self.section.source == "chat":
            messages = _check_messages(record.get("messages"))
            return self._chat(messages, answer_only=answer_only, tools=record.get("tools"))
        if "prompt" in record:  # a dataset factory's own prompt text (SQuAD, HellaSwag): verbatim
            prompt, answer = _text(record["prompt"]), _text(record.get("answer"))
            if not answer.strip():
                raise SkippedExample("empty answer")
            if self.use_template:
                messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
                return self._chat(messages, answer_only=answer_only)
            return encode_plain(
                self.tokenizer, prompt=prompt, answer=answer, answer_only=answer_only, bos=self.bos
            )
        context, question, answer = (_text(record.get(k)) for k in ("context", "question", "answer"))
        if not answer.strip():
            raise SkippedExample("empty answer")
        if not (context.strip() or question.strip()):
            raise SkippedExample("empty prompt")
        if self.use_template:
            messages = []
            if context and question:
                messages.append({"role": "system", "content": context})
            messages.append({"role": "user", "content": question or context})
            messages.append({"role": "assistant", "content": answer})
            return self._chat(messages, answer_only=answer_only)
        prompt = format_plain_prompt(context=context, question=question)
        return encode_plain(
            self.tokenizer, prompt=prompt, answer=answer, answer_only=answer_only, bos=self.bos
        )


def read_chat_template(key: str, value: str) -> str:
    """A Jinja template, or (AutoModel's convention) the path of a ``.jinja`` file holding one."""
    if value.strip().endswith(".jinja") and "{" not in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(key, value, "names a .jinja file that does not exist")
        return path.read_text()
    return value


def fit_to_length(example: Example, *, max_tokens: int, truncate: bool) -> Example:
    """`example` if it has at most `max_tokens` tokens, else cut (with `truncate`) or skipped."""
    if len(example.ids) > max_tokens:
        if not truncate:
            raise SkippedExample(f"longer than the {max_tokens - 1}-token row")
        example = Example(example.ids[:max_tokens], example.label_mask[:max_tokens])
    if not any(example.label_mask[1:]):
        raise SkippedExample("no answer token" + (" left after truncation" if truncate else ""))
    return example


# ---- rows ------------------------------------------------------------------------------------
def shifted(example: Example) -> tuple[list[int], list[int]]:
    """(inputs, labels) of one example: ``labels[t] = ids[t+1]`` where that token is a label."""
    ids, mask = example.ids, example.label_mask
    labels = [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
    return ids[:-1], labels


class SFTDataset:
    """Rows of (input_ids, labels, position_ids), each ``[rows, length]``; same interface as
    `PackedDataset` (``len``, ``batch(indices)``). `lengths`: each one-example row's real tokens
    (None for packed rows, which are full)."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        stats: dict[str, Any],
        lengths: torch.Tensor | None = None,
    ) -> None:
        self.input_ids, self.labels, self.position_ids = input_ids, labels, position_ids
        self.seq_length = input_ids.shape[1]
        self.stats = stats
        self.lengths = lengths

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ix = torch.as_tensor(indices, dtype=torch.long)
        return self.input_ids[ix], self.labels[ix], self.position_ids[ix]


#: What a micro-batch of one-example rows is rounded up to when the layout needs no larger multiple.
PAD_MULTIPLE = 64


@dataclass(frozen=True)
class BatchLength:
    """How long a micro-batch of one-example rows is: its longest example rounded up to
    `multiple`, at most the rows' width (``seq_length``). With `buckets` (compiled layers) the
    length is `multiple` times a power of two, so a run sees at most ``log2(width / multiple) + 2``
    shapes."""

    multiple: int
    buckets: bool = False

    def of(self, longest: int, *, cap: int) -> int:
        """The micro-batch length for a longest example of `longest` tokens in rows of `cap`."""
        units = max(1, -(-longest // self.multiple))
        if self.buckets:
            units = 1 << (units - 1).bit_length()
        return min(units * self.multiple, cap)


class BatchLengthRows:
    """A view of an `SFTDataset` of one-example rows whose ``batch(indices)`` is cut to
    `BatchLength.of` its longest row (other attributes pass through)."""

    def __init__(self, dataset: SFTDataset, length: BatchLength) -> None:
        assert dataset.lengths is not None, "packed rows are full: nothing to cut"
        self.dataset, self.length, self.lengths = dataset, length, dataset.lengths

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        longest = int(self.lengths[torch.as_tensor(indices, dtype=torch.long)].max())
        n = self.length.of(longest, cap=self.dataset.seq_length)
        ids, labels, pos = self.dataset.batch(indices)
        return ids[:, :n].contiguous(), labels[:, :n].contiguous(), pos[:, :n].contiguous()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataset, name)


def batch_length_rows(dataset: Any, length: BatchLength | None) -> Any:
    """`dataset` with micro-batches as long as `length` makes them, where it is an `SFTDataset`
    of one-example rows; else (packed rows, other kinds, `length` None) `dataset` itself."""
    if length is None or not isinstance(dataset, SFTDataset) or dataset.lengths is None:
        return dataset
    return BatchLengthRows(dataset, length)


def starts_row(*, used: int, length: int, row_length: int, packed: bool) -> bool:
    """Whether an example of `length` input tokens opens a new row after a row holding `used`
    tokens (0: no row open yet): always one example per row, else when it does not fit."""
    return used > 0 and (not packed or used + length > row_length)


def build_rows(
    examples: list[Example], *, row_length: int, pad_token_id: int, packed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded rows (one example each) or packed rows (whole examples, in order, while they fit).

    Every example must already fit (``len(ids) - 1 <= row_length``). Padding is ``pad_token_id``
    with label -100; in packed rows its positions restart at 0 like a document of its own.
    """
    rows: list[tuple[list[int], list[int], list[int]]] = []
    cur: tuple[list[int], list[int], list[int]] = ([], [], [])
    for ex in examples:
        inputs, labels = shifted(ex)
        assert len(inputs) <= row_length
        if starts_row(used=len(cur[0]), length=len(inputs), row_length=row_length, packed=packed):
            rows.append(cur)
            cur = ([], [], [])
        cur[0].extend(inputs)
        cur[1].extend(labels)
        cur[2].extend(range(len(inputs)))
    if cur[0]:
        rows.append(cur)
    out_ids = torch.full((len(rows), row_length), pad_token_id, dtype=torch.long)
    out_labels = torch.full((len(rows), row_length), IGNORE_INDEX, dtype=torch.long)
    out_pos = torch.zeros((len(rows), row_length), dtype=torch.long)
    for r, (ids, labels, pos) in enumerate(rows):
        n = len(ids)
        out_ids[r, :n] = torch.tensor(ids)
        out_labels[r, :n] = torch.tensor(labels)
        pad_positions = torch.arange(row_length - n)
        out_pos[r] = torch.cat(
            [torch.tensor(pos, dtype=torch.long), pad_positions if packed else pad_positions + n]
        )
    return out_ids, out_labels, out_pos


# ---- records ---------------------------------------------------------------------------------
def _load_table(section: ExampleSection, *, skipped: Counter[str] | None = None) -> Any:
    """A `datasets.Dataset` from local files, a local directory or a cached Hub dataset id; with
    ``bad_rows: skip`` bad rows of JSON / CSV / Parquet files are left out and counted into `skipped`."""
    datasets = optional("datasets", needed_for="SFT rows")

    key = f"{section.SECTION}.{section.PATH_KEY}"
    src = section.path_or_dataset_id
    paths = src if isinstance(src, list) else [src]
    local = [Path(p).expanduser() for p in paths]
    if all(p.is_file() for p in local):
        builders = {_EXTENSION_BUILDERS.get("".join(p.suffixes[-1:]).lower()) for p in local}
        if None in builders or len(builders) != 1:
            raise ConfigError(key, src, f"must be files of one kind: {', '.join(_EXTENSION_BUILDERS)}")
        kind, data_files, directory = builders.pop(), [str(p) for p in local], None
        split = "train" + section.split[section.split.index("[") :] if "[" in section.split else "train"
    elif isinstance(src, list):
        missing = next(str(p) for p in local if not p.is_file())
        raise ConfigError(key, missing, "does not exist (only local files are read from a list)")
    else:
        kind, data_files = None, None
        directory = resolve_local_or_cached(src, key=key, repo_type="dataset")
    try:
        if getattr(section, "bad_rows", "error") == "skip":  # rows read here, not by `datasets`
            files = local
            if directory is not None:  # a dataset folder (a Hub snapshot): its split's data files
                files = split_data_files(directory, name=section.name, split=section.split, key=key)
            sliced = "train" + section.split[section.split.index("[") :] if "[" in section.split else "train"
            ds = _good_rows_table(section, files, split=sliced, skipped=skipped)
        elif directory is None and kind == "csv":  # one CSV reader for both modes (`table_rows`)
            ds = _csv_table(section, local, split=split)
        elif directory is None:
            assert kind is not None  # local files: their builder was checked above
            ds = datasets.load_dataset(kind, data_files=data_files, split=split)
        else:  # a folder of data files (a Hub snapshot): datasets' file readers, no loading script
            ds = datasets.load_dataset(str(directory), name=section.name, split=section.split)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable source is a config problem
        what = f"split {section.split!r} of {directory}" if directory is not None else f"{kind} files"
        raise ConfigError(
            key, src, f"cannot be read as {what} ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    shuffle_seed: int | None = getattr(section, "shuffle_seed", None)
    if shuffle_seed is not None:  # AutoModel: shuffled before the limit
        ds = ds.shuffle(seed=shuffle_seed)
    if section.limit_dataset_samples is not None:
        ds = ds.select(range(min(len(ds), section.limit_dataset_samples)))
    return ds


def _csv_table(section: ExampleSection, files: list[Path], *, split: str) -> Any:
    """Local CSV files as a `datasets.Dataset` of text values (`table_rows.read_csv_rows`, strict:
    the first bad row is a `DataError` naming file and line)."""
    text_columns, list_columns = section_columns(section)
    key = f"{section.SECTION}.{section.PATH_KEY}"
    rows: list[dict[str, Any]] = []
    for f in files:
        rows += read_csv_rows(f, columns=text_columns + list_columns, key=key, strict=True)[0]
    return _sliced(_rows_dataset(rows), split)


def _rows_dataset(rows: list[dict[str, Any]]) -> Any:
    """Rows (dicts with the same keys) as a `datasets.Dataset`."""
    datasets = optional("datasets", needed_for="SFT rows")

    return datasets.Dataset.from_list(rows)


def _sliced(ds: Any, split: str) -> Any:
    """`ds` cut to the slice of a split spec such as ``train[:100]`` (whole for ``train``)."""
    datasets = optional("datasets", needed_for="SFT rows")

    if "[" in split:
        (part,) = datasets.ReadInstruction.from_spec(split).to_absolute({"train": len(ds)})
        ds = ds.select(range(part.from_, part.to))
    return ds


def _good_rows_table(
    section: ExampleSection, files: list[Path], *, split: str, skipped: Counter[str] | None
) -> Any:
    """The good rows of data files as a `datasets.Dataset` (``split`` slice applied)."""
    rows, bad = read_good_rows(section, files)
    if skipped is not None:
        skipped.update(bad)
    return _sliced(_rows_dataset(rows), split)


def load_records(section: ExampleSection, *, skipped: Counter[str] | None = None) -> list[dict[str, Any]]:
    """The section's examples as dicts with role keys (context / question / answer, or messages);
    bad file rows skipped under ``bad_rows: skip`` are counted into `skipped`."""
    if section.source == "stdlib_docstrings":
        records = stdlib_docstring_examples(split=section.split)
        if section.limit_dataset_samples is not None:
            records = records[: section.limit_dataset_samples]
        return records
    ds = _load_table(section, skipped=skipped)
    default = {"messages": "messages"} if section.source == "chat" else {}
    mapping = dict(getattr(section, "column_mapping", None) or default)
    if section.source == "chat" and "messages" not in mapping:
        mapping["messages"] = "messages"
    for role, column in mapping.items():
        if column not in ds.column_names:
            raise ConfigError(
                f"{section.SECTION}.column_mapping.{role}",
                column,
                f"is not a column of the dataset; its columns: {', '.join(ds.column_names)}",
            )
    if section.source == "chat" and "tools" in ds.column_names:
        mapping["tools"] = "tools"
    columns = {role: ds[column] for role, column in mapping.items()}
    return [{role: values[i] for role, values in columns.items()} for i in range(len(ds))]


def _report(section: ExampleSection, stats: dict[str, Any]) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    skipped = stats["skipped"]
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
    line = (
        f"{section.SECTION}: {stats['examples']} examples -> {stats['rows']} rows of "
        f"{'' if stats['packed'] else 'at most '}{stats['row_length']} tokens, "
        f"{stats['label_tokens']} label tokens"
    )
    if skipped:
        line += f"; skipped {sum(skipped.values())} of {stats['records']} ({why})"
    print(line, file=sys.stderr, flush=True)


def build_sft_dataset(
    section: ExampleSection,
    tokenizer: Any,
    *,
    packed_sequence_size: int,
    records: list[dict[str, Any]] | None = None,
) -> SFTDataset:
    """Read, encode, fit and lay out the section's examples (see the module docstring); `records`
    (role -> value) replace reading the section's columns (a dataset factory's own reader)."""
    encoder = ExampleEncoder(section, tokenizer)  # first: a template it refuses names its key
    skipped: Counter[str] = Counter()  # bad file rows (bad_rows: skip), then unusable examples
    records = load_records(section, skipped=skipped) if records is None else records
    bad_file_rows = sum(skipped.values())
    packed = packed_sequence_size > 0
    row_length = row_length_of(section, packed_sequence_size=packed_sequence_size)
    fitted = fitted_examples(
        encoder, records, row_length=row_length, truncate=section.truncate, skipped=skipped
    )
    examples = list(fitted)
    if not examples:
        raise no_usable_example(section, skipped)
    pad = getattr(tokenizer, "pad_token_id", None)
    ids, labels, pos = build_rows(
        examples,
        row_length=row_length,
        pad_token_id=tokenizer.eos_token_id if pad is None else pad,
        packed=packed,
    )
    lengths = None if packed else torch.tensor([len(ex.ids) - 1 for ex in examples], dtype=torch.long)
    stats = {
        "records": len(records) + bad_file_rows,
        "examples": len(examples),
        "skipped": dict(skipped),
        "rows": ids.shape[0],
        "row_length": row_length,
        "packed": packed,
        "label_tokens": int((labels != IGNORE_INDEX).sum()),
    }
    _report(section, stats)
    return SFTDataset(ids, labels, pos, stats=stats, lengths=lengths)


def row_length_of(section: ExampleSection, *, packed_sequence_size: int) -> int:
    """A row's tokens: ``packed_sequence_size`` when packing (> 0), else the section's ``seq_length``."""
    return packed_sequence_size if packed_sequence_size > 0 else section.seq_length


def fitted_examples(
    encoder: ExampleEncoder,
    records: list[dict[str, Any]],
    *,
    row_length: int,
    truncate: bool,
    skipped: Counter[str],
) -> Iterator[Example]:
    """The usable examples of `records`, in order, each fitted to a row of `row_length` tokens; the
    unusable ones counted into `skipped` by reason (lazily: a count may stop early)."""
    for record in records:
        try:
            yield fit_to_length(encoder(record), max_tokens=row_length + 1, truncate=truncate)
        except SkippedExample as e:
            skipped[str(e)] += 1


def no_usable_example(section: ExampleSection, skipped: Counter[str]) -> ConfigError:
    """The refusal of a section none of whose records gives an example."""
    reasons = ", ".join(f"{n} {r}" for r, n in skipped.items()) or "no records"
    return ConfigError(
        f"{section.SECTION}.{section.PATH_KEY}",
        section.path_or_dataset_id,
        f"yields no usable example ({reasons})",
    )


def count_sft_rows(
    section: ExampleSection,
    tokenizer: Any,
    *,
    packed_sequence_size: int,
    at_least: int,
    records: list[dict[str, Any]] | None = None,
) -> int:
    """The rows `build_sft_dataset` gives, or `at_least` once that many are certain, without
    building them: the same records, encoder, length filter and row rule (`starts_row`), encoding
    examples only until the `at_least`-th row opens (the cost of a pre-launch count: every record
    read, about `at_least` rows of examples tokenized). No usable example is its `ConfigError`."""
    encoder = ExampleEncoder(section, tokenizer)
    skipped: Counter[str] = Counter()
    if records is None:
        with no_progress_bars():
            records = load_records(section, skipped=skipped)
    packed = packed_sequence_size > 0
    row_length = row_length_of(section, packed_sequence_size=packed_sequence_size)
    rows, used = 0, 0
    fitted = fitted_examples(
        encoder, records, row_length=row_length, truncate=section.truncate, skipped=skipped
    )
    for example in fitted:
        length = len(example.ids) - 1
        if rows == 0 or starts_row(used=used, length=length, row_length=row_length, packed=packed):
            rows, used = rows + 1, 0
            if rows == at_least:
                return rows
        used += length
    if rows == 0:
        raise no_usable_example(section, skipped)
    return rows
