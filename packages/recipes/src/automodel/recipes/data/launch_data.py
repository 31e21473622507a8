"""The pre-launch data checks that need the model: its ``vocab_size`` against the tokenizer and the
corpus files, and the text rows the run would read (run once by `preflight.check_run_files`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from automodel.data.text_rows import check_text_keys
from automodel.data.token_ids import check_corpus_ids, check_tokenizer_ids
from automodel.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer
from automodel.mesh.model_parts import text_config
from automodel.recipes.model import build_hf_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from automodel.recipes.config.recipe import RecipeConfig


def model_vocab(hf_config: PretrainedConfig) -> tuple[int, str]:
    """``(vocab_size, the key that sets it)`` of the model's text decoder."""
    text = text_config(hf_config)
    key = "model.config.vocab_size" if text is hf_config else "model.config.text_config.vocab_size"
    return int(text.vocab_size), key


def run_tokenizer(cfg: RecipeConfig) -> ByteTokenizer | HFTokenizer:
    """The run's tokenizer, built as every rank builds it."""
    section = cfg.tokenizer
    return build_tokenizer(
        section.path, trust_remote_code=section.trust_remote_code, add_bos_token=section.add_bos_token
    )


def check_data_fits_model(cfg: RecipeConfig, *, hf_config: PretrainedConfig | None = None) -> None:
    """Rows without their text (``bad_rows: error``), then ids the model cannot embed: the
    tokenizer's (not where its own code would run: the ranks check it) and the corpus files'."""
    for section in (cfg.dataset, cfg.validation_dataset):
        check_text_keys(section)
    if hf_config is None:
        hf_config = build_hf_config(cfg.model, announce=False)
    vocab_size, key = model_vocab(hf_config)
    if not cfg.tokenizer.trust_remote_code:
        tokenizer = run_tokenizer(cfg)
        check_tokenizer_ids(tokenizer, vocab_size=vocab_size, path=cfg.tokenizer.path, vocab_key=key)
    for section in (cfg.dataset, cfg.validation_dataset):
        if section is not None:
            check_corpus_ids(section, vocab_size=vocab_size)
