"""Where this project keeps a default different from NeMo AutoModel's on purpose: one line each.

The lines are printed once at start-up (`recipes train` rank 0, `recipes validate`), and only when
the key is absent from the YAML, so an explicit setting is never commented on.
"""

from __future__ import annotations

from automodel.recipes.config.recipe import RecipeConfig

#: AutoModel's defaults compared here (nemo_automodel StepSchedulerConfig / CheckpointingConfig)
AUTOMODEL_CKPT_EVERY_STEPS = 100
AUTOMODEL_NUM_EPOCHS = 10


def startup_notes(cfg: RecipeConfig, raw: dict) -> list[str]:
    """The lines for `cfg` (parsed) whose keys `raw` (the translated YAML) leaves out."""
    notes = []
    steps = raw.get("step_scheduler") or {}
    ckpt = raw.get("checkpoint")
    every = cfg.step_scheduler.ckpt_every_steps
    if ckpt is None:
        notes.append(
            "checkpoint: no section, so no checkpoints are written (AutoModel saves them by default); "
            "add checkpoint: {enabled: true}"
        )
    elif cfg.checkpoint.enabled and every is None:
        notes.append(
            "step_scheduler.ckpt_every_steps unset: one checkpoint at the end "
            f"(AutoModel: every {AUTOMODEL_CKPT_EVERY_STEPS} steps)"
        )
    if every is not None and not cfg.checkpoint.enabled:
        notes.append(f"step_scheduler.ckpt_every_steps={every} has no effect: checkpointing is off")
    if cfg.step_scheduler.save_checkpoint_every_epoch and not cfg.checkpoint.enabled:
        notes.append("step_scheduler.save_checkpoint_every_epoch=true has no effect: checkpointing is off")
    if "num_epochs" not in steps and cfg.step_scheduler.max_steps is None:
        notes.append(
            f"step_scheduler: neither max_steps nor num_epochs: 1 epoch here (AutoModel: {AUTOMODEL_NUM_EPOCHS})"
        )
    if cfg.validation_dataset is not None and "val_batches" not in steps:
        notes.append(
            "validation: every step_scheduler.val_every_steps steps and at the last, on the first "
            f"val_batches={cfg.step_scheduler.val_batches} global batches of validation_dataset (AutoModel: "
            "also at each ckpt_every_steps step, on all of it; step_scheduler.val_batches: null: all full global batches)"
        )
    if not cfg.dataloader.drop_last:
        notes.append(
            "dataloader.drop_last: false: an epoch's last partial global batch is still dropped here"
        )
    dataset = raw.get("dataset") or {}
    sft_rows = hasattr(cfg.dataset, "answer_only_loss_mask") and cfg.packed_sequence.packed_sequence_size == 0
    if sft_rows and "seq_length" not in dataset:
        notes.append(
            f"dataset.seq_length unset: examples longer than {cfg.dataset.seq_length} tokens are skipped "
            "and counted (AutoModel keeps every example)"
        )
    if sft_rows and cfg.distributed.pipeline_config is not None:
        notes.append(
            f"pipeline parallelism: every micro-batch is padded to dataset.seq_length={cfg.dataset.seq_length} "
            "(its stages exchange fixed-shape activations; without pp_size > 1, and in AutoModel, a "
            "micro-batch is padded to its longest example)"
        )
    return notes
