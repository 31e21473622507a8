"""Checks that `recipes train` runs before any rank starts, for mistakes the ranks would otherwise
meet minutes later, once per rank, as tracebacks: optimizer arguments, the checkpoint it restores,
the pretrained model directory (`run_files`), the LoRA adapter to start from (``peft.initial_adapter``),
unreadable data files and rows, and a training set with fewer rows than a global batch
(`data.row_counts`). Each raises `ConfigError` naming the key, or
`DataError` naming the file and line (exit 2, one line).
"""

from __future__ import annotations

import difflib
import inspect
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from automodel.data.tokenizer import TOKENIZER_FILES, has_tokenizer_files
from automodel.recipes.checkpoint.paths import (
    CheckpointError,
    checkpoint_root,
    list_step_dirs,
    newest_complete,
    resolve_restore_spec,
)
from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.config.sections import OptimizerSection, TokenizerSection
from automodel.recipes.data.kinds import check_rows
from automodel.recipes.data.launch_data import check_data_fits_model
from automodel.recipes.data.row_counts import check_resume_position, check_row_counts
from automodel.recipes.errors import ConfigError
from automodel.recipes.instantiate import locate
from automodel.recipes.model import build_hf_config, build_meta_model, pretrained_dir
from automodel.recipes.peft import apply_lora, check_initial_adapter
from automodel.recipes.run_files import check_model_dir, checkpoint_problem

#: Optimizer options whose validity depends on the device of the parameters: not tried on CPU here.
DEVICE_DEPENDENT_OPTIONS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def check_tokenizer_dir(section: TokenizerSection) -> None:
    """``tokenizer.path`` names a local directory on this machine holding tokenizer files (the
    section itself reads no disk; an empty one failed in every rank, naming no file)."""
    if section.path is None:
        return
    if not Path(section.path).is_dir():
        raise ConfigError("tokenizer.path", section.path, "is not a local directory")
    if not has_tokenizer_files(section.path):
        raise ConfigError(
            "tokenizer.path", section.path, f"holds none of the tokenizer files {', '.join(TOKENIZER_FILES)}"
        )


def check_optimizer_kwargs(section: OptimizerSection) -> None:
    """Build the optimizer once on a dummy matrix parameter; a failure names the ``optimizer.<key>`` at fault.

    An unknown keyword (``weight_decayy``) gets a did-you-mean; a bad value (``betas: [0.9]``,
    ``eps: -1``) is found by trying each key alone.
    """
    cls = locate("optimizer._target_", section.target)
    kwargs = {k: v for k, v in section.kwargs.items() if k not in DEVICE_DEPENDENT_OPTIONS}
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = [n for n in params if n not in ("self", "params")]
        for key, value in kwargs.items():
            if key not in params:
                close = difflib.get_close_matches(key, accepted, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(
                    f"optimizer.{key}",
                    value,
                    f"is not an argument of {cls.__name__}; {hint}accepted: {', '.join(accepted)}",
                )

    def build(options: dict[str, Any]) -> None:
        cls([torch.nn.Parameter(torch.zeros(2, 2))], **options)  # a matrix: every optimizer takes one

    try:
        build(kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the class raises for a bad value
        why = f"{type(e).__name__}: {e}"
        for key, value in kwargs.items():
            try:
                build({"lr": kwargs.get("lr", 1e-3), key: value})
            except Exception as alone:  # noqa: BLE001
                raise ConfigError(
                    f"optimizer.{key}",
                    value,
                    f"is refused by {cls.__name__} ({type(alone).__name__}: {alone})",
                ) from None
        raise ConfigError("optimizer", section.kwargs, f"is refused by {cls.__name__} ({why})") from None


def check_optimizer_on_model(section: OptimizerSection, model: nn.Module) -> None:
    """Build the optimizer on the meta-device model's trainable parameters, as the ranks will (an
    optimizer may refuse some parameters, e.g. ``torch.optim.Muon`` takes only matrices); meta
    tensors hold no data, so nothing is allocated. Run after `check_optimizer_kwargs`."""
    cls = locate("optimizer._target_", section.target)
    kwargs = {k: v for k, v in section.kwargs.items() if k not in DEVICE_DEPENDENT_OPTIONS}
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        cls(params, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the class raises for these parameters
        raise ConfigError(
            "optimizer._target_",
            section.target,
            f"cannot be built on this model's {len(params)} trainable parameters "
            f"({type(e).__name__}: {str(e)[:200]})",
        ) from None


def check_restore_from(cfg: RecipeConfig) -> None:
    """The checkpoint the run restores can be read (`run_files.checkpoint_problem`): the one
    ``checkpoint.restore_from`` names, else the newest complete one it resumes from on its own
    (with ``checkpoint.on_corrupt: fail``; ``previous`` lets the ranks fall back past a bad one)."""
    section = cfg.checkpoint
    if not section.enabled:
        return
    root = checkpoint_root(checkpoint_dir=section.checkpoint_dir, output_dir=cfg.output_dir)
    root_key = "checkpoint.checkpoint_dir" if section.checkpoint_dir else "output_dir"
    if root.exists() and not root.is_dir():
        raise ConfigError(root_key, str(root), "is a file where the run keeps its checkpoints (a directory)")
    if section.restore_from is None:
        newest = newest_complete(root, announce_skipped=False) if section.on_corrupt == "fail" else None
        problem = checkpoint_problem(newest) if newest is not None else None
        if problem is not None:
            raise ConfigError(
                root_key,
                str(root),
                f"the run would resume from its newest checkpoint: {problem}; name another with "
                "checkpoint.restore_from (or checkpoint.on_corrupt: previous falls back to an older one)",
            )
        return
    try:
        problem = checkpoint_problem(resolve_restore_spec(root, section.restore_from))
    except CheckpointError as e:  # LATEST unreadable
        problem = str(e)
    if problem is not None:
        there = ", ".join(p.name for _, p in list_step_dirs(root)) or "none"
        raise ConfigError(
            "checkpoint.restore_from", section.restore_from, f"{problem} (checkpoints in {root}: {there})"
        )


def check_run_files(cfg: RecipeConfig) -> None:
    """The files a run reads on this machine: the checkpoint it restores, the data rows and the
    pretrained weights (run by `launch_check.check_launch` with the optimizer check above)."""
    check_restore_from(cfg)

    check_rows(cfg.dataset)
    check_rows(cfg.validation_dataset)
    if cfg.model.config is None and (cfg.model.pretrained_path or cfg.model.pretrained_source):
        check_model_dir(cfg.model, pretrained_dir(cfg.model))
    check_data_fits_model(cfg)  # rows without text, token ids beyond the model's vocab_size
    check_resume_position(cfg)  # the global batch size its saved position counts
    note = check_row_counts(cfg)  # the training set fills a global batch
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    if cfg.peft is not None and cfg.peft.initial_adapter is not None:
        check_initial_adapter_dir(cfg)


def check_initial_adapter_dir(cfg: RecipeConfig) -> None:
    """``peft.initial_adapter``: its config (rank, alpha) and tensors against the model's adapters
    (a meta-device model with the run's LoRA applied; nothing is allocated)."""
    assert cfg.peft is not None
    hf_config = build_hf_config(cfg.model, announce=False)
    model = build_meta_model(hf_config, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    apply_lora(model, section=cfg.peft)
    check_initial_adapter(cfg.peft, model)
