"""`RecipeConfig`: the whole YAML, each section parsed and validated, plus cross-section rules."""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import replace
from typing import Any, cast

import torch

from automodel.data.hub_cache import resolve_local_or_cached
from automodel.data.tokenizer import has_tokenizer_files
from automodel.recipes._dist_setup import parse_distributed_section
from automodel.recipes.compat import translate
from automodel.recipes.compat.defaults import startup_notes
from automodel.recipes.config.build import derived
from automodel.recipes.config.checkpoint import CheckpointConfig
from automodel.recipes.config.kernels import parse_kernels_sections
from automodel.recipes.config.peft import PeftSection
from automodel.recipes.config.pretrain_yaml import adopt_dataset_tokenizer, default_index_mapping_dir
from automodel.recipes.config.recipe import DatasetConfig, LossFn, RecipeConfig
from automodel.recipes.config.sections import (
    CONSTANT_LR,
    ClipGradNormSection,
    DataloaderSection,
    DistEnvSection,
    LoggingSection,
    LRSchedulerSection,
    ModelSection,
    OptimizerSection,
    PackedSequenceSection,
    RngSection,
    StepSchedulerSection,
    TokenizerSection,
    ValidationDataloaderSection,
    build_section,
)
from automodel.recipes.config.trackers import MlflowSection, WandbSection
from automodel.recipes.data.kinds import parse_section
from automodel.recipes.errors import ConfigError, reject_unknown
from automodel.recipes.instantiate import locate
from automodel.recipes.parallelisms import parallelisms

__all__ = ["RecipeConfig", "parse_recipe_config"]

TOP_LEVEL_KEYS = (
    "model", "dataset", "validation_dataset", "tokenizer", "step_scheduler", "optimizer", "lr_scheduler",
    "loss_fn", "distributed", "packed_sequence", "checkpoint", "logging", "seed", "output_dir", "dist_env",
    "clip_grad_norm", "peft", "dataloader", "validation_dataloader", "rng", "kernels", "fp8",
    "wandb", "mlflow",
)  # fmt: skip
DEFAULT_LOSS_FN = "automodel.recipes.loss.LinearCrossEntropy"
#: NeMo AutoModel's loss targets, so its configs carry over: its masked CE reads full logits, its
#: fused linear CE is our chunked one.
NEMO_LOSS_FNS = {
    "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy": "automodel.recipes.loss.masked_cross_entropy_sum",
    "nemo_automodel.components.loss.linear_ce.FusedLinearCrossEntropy": "automodel.recipes.loss.LinearCrossEntropy",
}


def _loss_fn(data: object) -> LossFn:
    """The loss callable of ``loss_fn``: a dotted path (a class is instantiated without arguments)
    or ``{_target_: ..., **kwargs}``; NeMo AutoModel's targets map to ours (`NEMO_LOSS_FNS`)."""
    kwargs: dict[str, Any] = {}
    target = data
    if isinstance(data, dict):
        if "_target_" not in data:
            raise ConfigError("loss_fn", data, "must be a dotted path or a mapping with _target_")
        target, kwargs = data["_target_"], {k: v for k, v in data.items() if k != "_target_"}
    target = NEMO_LOSS_FNS.get(target, target) if isinstance(target, str) else target
    obj = locate("loss_fn._target_" if isinstance(data, dict) else "loss_fn", target)
    if isinstance(obj, type):
        try:
            obj = obj(**kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError("loss_fn", data, f"cannot be built with these keys ({e})") from None
    elif kwargs:
        raise ConfigError("loss_fn", data, f"{target} is a function: it takes no keys")
    if not callable(obj):
        raise ConfigError("loss_fn", data, "is not callable")
    return cast(LossFn, obj)


def _optimizer_section(data: object) -> OptimizerSection:
    """``optimizer:``: a torch.optim.Optimizer class (``_target_``, imported to check it) and its
    keyword arguments; absent: AdamW with lr 1e-3."""
    if data is None:
        return OptimizerSection()
    if not isinstance(data, dict):
        raise ConfigError("optimizer", data, "must be a mapping with a _target_")
    if "_target_" not in data:
        raise ConfigError("optimizer._target_", None, "is required (e.g. torch.optim.AdamW)")
    target = locate("optimizer._target_", data["_target_"])

    if not (isinstance(target, type) and issubclass(target, torch.optim.Optimizer)):
        raise ConfigError("optimizer._target_", data["_target_"], "is not a torch.optim.Optimizer class")
    kwargs = {k: v for k, v in data.items() if k != "_target_"}
    lr = kwargs.get("lr", 1e-3)
    if isinstance(lr, bool) or not isinstance(lr, int | float) or lr <= 0:
        raise ConfigError("optimizer.lr", lr, "must be a number > 0")
    kwargs["lr"] = float(lr)
    return OptimizerSection(target=data["_target_"], kwargs=kwargs)


def _checkpoint_section(data: object) -> CheckpointConfig:
    """The ``checkpoint:`` section built once (absent: checkpointing off); errors name the key."""
    if data is None:
        return CheckpointConfig(enabled=False)
    if not isinstance(data, dict):
        raise ConfigError("checkpoint", data, "must be a mapping")
    reject_unknown("checkpoint", data, set(CheckpointConfig.__dataclass_fields__))
    try:
        return CheckpointConfig(**data)
    except ValueError as e:
        msg = str(e)
        key = next((f"checkpoint.{k}" for k in data if f"checkpoint.{k}" in msg), "checkpoint")
        raise ConfigError(key, data.get(key.split(".")[-1], data), msg.split(", got")[0]) from None


def _dataset_section(data: object, *, validation: bool) -> DatasetConfig:
    """The section of the dataset kind that `data` selects (``source`` or a NeMo ``_target_``)."""
    return parse_section(data, validation=validation)


def _resolve_pretrained(model: ModelSection, tok: TokenizerSection) -> tuple[ModelSection, TokenizerSection]:
    """``model.pretrained_path`` becomes the local directory of the pretrained model (a Hub id is
    looked up in the local cache, never downloaded); ``tokenizer.path`` the tokenizer's directory:
    the tokenizer section's, else the model directory when it holds tokenizer files. Returns the
    resolved sections (new values)."""
    if model.pretrained_source is not None:
        local = resolve_local_or_cached(
            model.pretrained_source, key=model.pretrained_key, required_file="config.json"
        )
        model = derived(model, pretrained_path=str(local))
    if tok.pretrained_model_name_or_path is not None:
        local = resolve_local_or_cached(
            tok.pretrained_model_name_or_path, key="tokenizer.pretrained_model_name_or_path"
        )
        tok = derived(tok, path=str(local))
    elif (
        tok.path is None and model.pretrained_path is not None and has_tokenizer_files(model.pretrained_path)
    ):
        tok = derived(tok, path=model.pretrained_path)
    return model, tok


def parse_recipe_config(raw: dict) -> RecipeConfig:
    """Validate every section of `raw` (the loaded YAML); the first mistake raises `ConfigError`."""
    if not isinstance(raw, dict):
        raise ConfigError("config", raw, "must be a mapping of sections")

    original = raw
    translation = translate(raw)  # NeMo AutoModel's keys -> this project's (compat/aliases.py)
    raw = translation.raw
    reject_unknown("", raw, TOP_LEVEL_KEYS)
    if "model" not in raw:
        raise ConfigError("model", None, "section is required")
    if raw["model"] is None or not isinstance(raw["model"], dict):
        raise ConfigError(
            "model", raw["model"], "must be a mapping (model.config or model.pretrained_model_name_or_path)"
        )
    seed = raw.get("seed", 42)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError("seed", seed, "must be an int >= 0")
    output_dir = raw.get("output_dir")
    if not isinstance(output_dir, str) or not output_dir:
        raise ConfigError("output_dir", output_dir, "must be a non-empty path")
    loss_callable = _loss_fn(raw.get("loss_fn", DEFAULT_LOSS_FN))
    model = build_section(ModelSection, raw["model"])
    val = raw.get("validation_dataset")
    dataset = _dataset_section(raw.get("dataset"), validation=False)
    validation_dataset = None if val is None else _dataset_section(val, validation=True)
    tokenizer = build_section(TokenizerSection, raw.get("tokenizer"))
    steps = build_section(StepSchedulerSection, raw.get("step_scheduler"))
    optimizer = _optimizer_section(raw.get("optimizer"))
    lr_scheduler = (
        CONSTANT_LR if "lr_scheduler" not in raw else build_section(LRSchedulerSection, raw["lr_scheduler"])
    )
    distributed = parse_distributed_section(raw.get("distributed"), local_batch_size=steps.local_batch_size)
    packed_sequence = build_section(PackedSequenceSection, raw.get("packed_sequence"))
    checkpoint = _checkpoint_section(raw.get("checkpoint"))
    logging = build_section(LoggingSection, raw.get("logging"))
    dist_env = build_section(DistEnvSection, raw.get("dist_env"))
    clip_grad_norm = build_section(ClipGradNormSection, raw.get("clip_grad_norm"))
    peft = None if raw.get("peft") is None else build_section(PeftSection, raw["peft"])
    dataloader = build_section(DataloaderSection, raw.get("dataloader"))
    validation_dataloader = build_section(ValidationDataloaderSection, raw.get("validation_dataloader"))
    rng = build_section(RngSection, raw.get("rng"))
    kernels, fp8 = parse_kernels_sections(raw)
    wandb = None if raw.get("wandb") is None else build_section(WandbSection, raw["wandb"])
    mlflow = None if raw.get("mlflow") is None else build_section(MlflowSection, raw["mlflow"])

    tokenizer = adopt_dataset_tokenizer(tokenizer, [dataset, validation_dataset])
    dataset = default_index_mapping_dir(dataset, output_dir=output_dir)
    validation_dataset = default_index_mapping_dir(validation_dataset, output_dir=output_dir)
    model, tokenizer = _resolve_pretrained(model, tokenizer)
    cfg = RecipeConfig(
        model=model,
        dataset=dataset,
        validation_dataset=validation_dataset,
        tokenizer=tokenizer,
        step_scheduler=steps,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        loss_fn=loss_callable,
        distributed=distributed,
        packed_sequence=packed_sequence,
        checkpoint=checkpoint,
        logging=logging,
        dist_env=dist_env,
        clip_grad_norm=clip_grad_norm,
        peft=peft,
        seed=seed,
        output_dir=output_dir,
        raw=original,
        dataloader=dataloader,
        validation_dataloader=validation_dataloader,
        rng=rng,
        kernels=kernels,
        fp8=fp8,
        wandb=wandb,
        mlflow=mlflow,
        refusals=tuple(translation.refusals),
    )
    ss = cfg.step_scheduler
    # a parallelism that runs the local batch itself may run it a row at a time (pp's micro-batches)
    rows = [r for p in parallelisms() if (r := p.forward_rows(cfg.distributed)) is not None]
    one_row_per_forward = ss.local_batch_size == 1 or rows == [1]
    if cfg.packed_sequence.packed_sequence_size > 0 and not one_row_per_forward:
        raise ConfigError(
            "step_scheduler.local_batch_size",
            ss.local_batch_size,
            "must be 1 for packed sequences (packed_sequence_size > 0), or pipeline micro-batches of 1 row",
        )
    if (
        cfg.distributed.strategy_config.patch_is_packed_sequence
        and cfg.packed_sequence.packed_sequence_size > 0
    ):
        raise ConfigError(
            "distributed.patch_is_packed_sequence",
            True,
            "makes transformers treat every row as one document, but packed_sequence.packed_sequence_size="
            f"{cfg.packed_sequence.packed_sequence_size} packs several into a row; remove it",
        )
    if ss.val_every_steps is not None and cfg.validation_dataset is None:
        raise ConfigError(
            "step_scheduler.val_every_steps", ss.val_every_steps, "needs a validation_dataset section"
        )
    if cfg.validation_dataset is not None and ss.val_every_steps is None:
        warnings.warn(
            "validation_dataset is only evaluated at the end (no step_scheduler.val_every_steps)",
            stacklevel=2,
        )
    if cfg.dataloader.batch_size not in (None, ss.local_batch_size):
        raise ConfigError(
            "dataloader.batch_size",
            cfg.dataloader.batch_size,
            f"must be step_scheduler.local_batch_size={ss.local_batch_size} (the micro-batch) or null",
        )
    if cfg.logging.tensorboard:
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                "logging.tensorboard", True, "needs the tensorboard package (automodel-recipes[tensorboard])"
            )

    cfg = replace(cfg, notes=(*translation.notes, *startup_notes(cfg, raw, original=original)))
    if cfg.tokenizer.path is None and cfg.model.config is not None:
        vocab = cfg.model.config.get("vocab_size")
        if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab < 256:
            raise ConfigError("model.config.vocab_size", vocab, "must be >= 256 for the byte-level tokenizer")
    return cfg
