"""Refuse, before any rank starts, what this machine cannot run (never a silent fallback)."""

from __future__ import annotations

import torch
from transformers.utils import is_flash_attn_2_available

from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.errors import ConfigError
from automodel.recipes.kernels.checks import check_kernels_environment
from automodel.recipes.parallelisms import parallelisms
from automodel.recipes.preflight import check_tokenizer_dir
from automodel.recipes.strategies import get_strategy


def check_environment(cfg: RecipeConfig) -> None:
    """`ConfigError` naming the key when the config cannot run here: first the settings that parse
    but run on no machine (`RecipeConfig.refusals`, all of them named), then the files the config
    names (tokenizer directory, each parallelism's `check_files`), then `check_machine`."""
    if cfg.refusals:  # AutoModel settings that parse but are not implemented here (compat.translate)
        raise refusal_error(cfg.refusals)
    check_tokenizer_dir(cfg.tokenizer)
    for parallelism in parallelisms():  # the files a parallelism's section names (a pp schedule CSV)
        parallelism.check_files(cfg=cfg)
    check_machine(cfg)


def check_machine(cfg: RecipeConfig) -> None:
    """`ConfigError` naming the key when the configured strategy cannot run on this machine.

    `recipes validate` plans layouts for clusters it is not running on: it reports this error as a
    line ("recipes train on this machine refuses before launch: ...") instead of refusing.
    """
    _check_attention(cfg.model.attn_implementation)
    _check_backend(cfg.dist_env.backend)

    check_kernels_environment(cfg)
    get_strategy(cfg.distributed.strategy).check_environment(cfg.distributed.strategy_config)


def refusal_error(refusals: tuple[ConfigError, ...]) -> ConfigError:
    """The first refusal, naming the others too: one run of `recipes train` lists every key to edit."""
    first, rest = refusals[0], refusals[1:]
    if not rest:
        return first
    also = "; ".join(str(e) for e in rest)
    return ConfigError(first.key, first.value, f"{first.message} (also refused: {also})")


def _check_attention(requested: str) -> None:
    """An attention implementation this machine cannot train with is refused here, not met as an
    import error or a missing backward inside every rank."""
    if requested == "flash_attention_2":
        if not is_flash_attn_2_available():
            raise ConfigError(
                "model.attn_implementation",
                requested,
                "needs the flash-attn package and a CUDA GPU, which this machine lacks; use sdpa or eager",
            )
    if requested == "flex_attention" and not torch.cuda.is_available():
        # torch's FlexAttention raises NotImplementedError for a backward on CPU tensors
        raise ConfigError(
            "model.attn_implementation",
            requested,
            f"has no backward on CPU in torch {torch.__version__} and this machine has no CUDA GPU, so "
            "training would fail in the first step; use sdpa or eager here",
        )


def _check_backend(backend: str | None) -> None:
    """nccl needs CUDA: without it every rank would fail in init_process_group."""
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "dist_env.backend",
            backend,
            "needs CUDA GPUs, which this machine lacks; use gloo, or leave it unset (nccl with CUDA, else gloo)",
        )
