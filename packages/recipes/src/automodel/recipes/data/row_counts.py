"""The row-count rules, checked before launch: a run whose training set holds fewer rows than one
global batch is refused by `recipes train` before any rank starts and by `recipes validate`.

One rule, one home: `automodel.data.sampler.check_rows_fill_batch`, which every rank's sampler
checks again, here on the rows the section's kind counts with its builder's own code
(`kinds.count_rows`; ``packed_sequence.max_packs`` caps them as in the ranks). What a count costs:

- SFT (``instruction``, ``chat``, ``squad``, ``hellaswag``): every record read, examples tokenized
  only until ``global_batch_size`` rows are certain (packed or not);
- pretraining text: documents tokenized until then;
- Megatron corpora and blends: the ``.idx`` headers and pointers (`pretrain_build.megatron_length`:
  no sample order is built, nothing is written to ``index_mapping_dir``); whether a weighted blend
  asks a corpus for more samples than its margin holds stays the ranks' check (it needs the blend's
  interleave, linear in its size);
- nanoGPT shards: opened as the ranks open them (memory-mapped; with ``align_to_bos`` and no
  ``.bos.idx`` beside a shard, one scan of it for BOS tokens);
- ``streaming``: nothing (a stream has no length: its run is ``max_steps`` long); a start-up line
  says so, and a dp rank whose share of the stream holds no document is refused in the ranks.

A resume keeps the global batch size its saved position counts (`sampler.check_position_batch`,
read from the checkpoint it restores: one small entry). Whether the saved position's row count is
still the dataset's (`sampler.check_position_rows`) stays the ranks' check: it needs every row
counted, for SFT and text every example tokenized once more before launch.

The validation split is evaluated whatever its size; its first row is counted too, so its builder's
own refusals (no usable example, an empty corpus split) come before launch as well, and a split
that gives no row at all (text shorter than one row), whose loss would be 0/0, is refused
(`check_rows_to_evaluate`, which the ranks check again on the rows they built). A tokenizer with
``trust_remote_code`` runs its code only in the ranks: its rows are not counted here (a start-up
line says so) and the ranks refuse, with the same messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from automodel.data.sampler import check_position_batch, check_rows_fill_batch
from automodel.data.tokenizer import has_tokenizer_files
from automodel.recipes.checkpoint.paths import checkpoint_root
from automodel.recipes.checkpoint.saved_position import restored_checkpoint, saved_data_position
from automodel.recipes.data.kinds import check_paths, count_rows, kind_of
from automodel.recipes.data.launch_data import run_tokenizer
from automodel.recipes.errors import ConfigError

if TYPE_CHECKING:
    from automodel.recipes.config.recipe import DatasetConfig, RecipeConfig


def check_row_counts(cfg: RecipeConfig) -> str | None:
    """Refuse a training set smaller than ``step_scheduler.global_batch_size`` (`ConfigError`
    naming the key and value, the rank's message) and any split its builder refuses; returns the
    start-up line when the rows cannot be counted here (None otherwise)."""
    ss = cfg.step_scheduler
    if cfg.tokenizer.trust_remote_code:
        return (
            "note: the dataset's rows are counted in the ranks (tokenizer.trust_remote_code: the "
            "tokenizer's own code runs only there); fewer rows than "
            f"step_scheduler.global_batch_size={ss.global_batch_size} is refused there"
        )
    tokenizer = run_tokenizer(cfg)
    seq = cfg.packed_sequence.packed_sequence_size
    rows = count_rows(
        cfg.dataset, tokenizer, packed_sequence_size=seq, seed=cfg.seed, at_least=ss.global_batch_size
    )
    if cfg.validation_dataset is not None:
        val = count_rows(
            cfg.validation_dataset, tokenizer, packed_sequence_size=seq, seed=cfg.seed, at_least=1
        )
        check_rows_to_evaluate(cfg.validation_dataset, rows=val)
    if rows is None:
        return (
            f"note: dataset (source: {kind_of(cfg.dataset).name}) is not counted before launch: a "
            "stream has no length; a dp rank whose share of it holds no document is refused in the ranks"
        )
    limit = cfg.packed_sequence.max_packs
    try:
        check_rows_fill_batch(
            num_rows=rows if limit is None else min(rows, limit), global_batch_size=ss.global_batch_size
        )
    except ValueError as e:  # the rank's refusal (`trainer`), word for word
        raise ConfigError("step_scheduler.global_batch_size", ss.global_batch_size, str(e)) from None
    return None


def check_rows_to_evaluate(section: DatasetConfig, *, rows: int | None) -> None:
    """Refuse a validation split without a row (text shorter than one row): its loss would be 0/0.
    Checked here on the count and again by every rank on the rows it built (`trainer`), for a run
    whose rows were not counted before launch; None (not counted) passes."""
    if rows != 0:
        return
    key = getattr(section, "PATH_KEY", "path")
    raise ConfigError(
        f"{section.SECTION}.{key}",
        getattr(section, key, None),
        "gives no row to evaluate (fewer tokens than one row): its validation loss would be 0/0",
    )


def check_resume_position(cfg: RecipeConfig) -> None:
    """Refuse a resume under another ``step_scheduler.global_batch_size`` than its checkpoint's
    data position counts (the rule `sampler.check_position_batch`, which the ranks check again)."""
    section = cfg.checkpoint
    if not section.enabled:
        return
    root = checkpoint_root(checkpoint_dir=section.checkpoint_dir, output_dir=cfg.output_dir)
    path = restored_checkpoint(root, restore_from=section.restore_from)
    if path is None:
        return
    try:
        state = saved_data_position(path)
    except Exception:  # noqa: BLE001 - an unreadable entry: the ranks' restore names it
        return
    if state is None:
        return
    gbs = cfg.step_scheduler.global_batch_size
    try:
        check_position_batch(state, global_batch_size=gbs)
    except ValueError as e:
        raise ConfigError("step_scheduler.global_batch_size", gbs, f"resuming from {path}: {e}") from None


def validate_row_counts(cfg: RecipeConfig) -> list[str]:
    """`recipes validate`: `check_row_counts` where the data and the tokenizer are on this machine
    (it refuses the same way), else the report's line saying the rows were not counted."""
    try:
        check_paths(cfg.dataset)
        check_paths(cfg.validation_dataset)
    except ConfigError as e:
        return [f"rows not counted: the data is not on this machine ({e})"]
    tokenizer = cfg.tokenizer.path
    if tokenizer is not None and not has_tokenizer_files(tokenizer):
        return [f"rows not counted: tokenizer.path={tokenizer!r} holds no tokenizer on this machine"]
    note = check_row_counts(cfg)
    return [] if note is None else [note]
