"""Where this project keeps a default different from NeMo AutoModel's on purpose: one line each.

The lines are printed once at start-up (`recipes train` rank 0, `recipes validate`), and only when
the key is absent from the YAML, so an explicit setting is never commented on. Where NeMo
AutoModel 0.7 itself would train the same file differently (`automodel_file_notes`: mixed
precision on CPU, which seed, the label of the prompt's last token, LoRA's first draws), the line is printed only for
AutoModel's own files (a ``_target_`` naming ``nemo_automodel``).
"""

from __future__ import annotations

from typing import Any

from automodel.recipes.config.recipe import RecipeConfig

#: AutoModel's defaults compared here (nemo_automodel StepSchedulerConfig / CheckpointingConfig)
AUTOMODEL_CKPT_EVERY_STEPS = 100
AUTOMODEL_NUM_EPOCHS = 10
#: AutoModel 0.7's seed when the file has no top-level ``seed`` (it does not read ``rng.seed``)
AUTOMODEL_SEED = 42
#: dataset sources AutoModel formats with ``format_prompt_completion`` when there is no chat template
PROMPT_COMPLETION = ("squad", "instruction")


def is_automodel_file(raw: Any) -> bool:
    """Whether the YAML mapping `raw` (as written) is one of NeMo AutoModel's recipe files: a
    ``_target_`` somewhere names a ``nemo_automodel`` object."""
    if isinstance(raw, dict):
        target = raw.get("_target_")
        if isinstance(target, str) and target.startswith("nemo_automodel"):
            return True
        return any(is_automodel_file(v) for v in raw.values())
    if isinstance(raw, list):
        return any(is_automodel_file(v) for v in raw)
    return False


def automodel_file_notes(cfg: RecipeConfig, original: dict) -> list[str]:
    """Where NeMo AutoModel 0.7 trains the same file (`original`, as written) differently."""
    notes = []
    if "mp_policy" in cfg.distributed.machine_keys:  # FSDP2 without the key: this machine's default
        notes.append(
            "distributed.mp_policy unset: this run computes in fp32 on CPU and in bf16 on CUDA; AutoModel 0.7 "
            "shards with bf16 compute by default on CPU too (set distributed.mp_policy to choose)"
        )
    rng = original.get("rng")
    rng_seed = rng.get("seed") if isinstance(rng, dict) else None
    if rng_seed is not None and "seed" not in original and rng_seed != AUTOMODEL_SEED:
        notes.append(
            f"rng.seed={rng_seed} seeds this run; AutoModel 0.7 ignores rng.seed and seeds with the top-level "
            f"seed (default {AUTOMODEL_SEED}): add seed: {rng_seed} to seed both the same"
        )
    if cfg.peft is not None and cfg.peft.initial_adapter is None:
        notes.append(
            f"peft: lora_A ({cfg.peft.lora_A_init}) is drawn from this run's per-parameter (seed, name) generators, "
            "the same on every layout; AutoModel 0.7 draws each rank's shard of it from that rank's own stream "
            "(seed + rank, after the base weights' random init), so the adapters start from other values of the "
            "same distribution and the losses agree in distribution, not step for step (peft.initial_adapter: "
            "start from an adapter directory, e.g. the one AutoModel starts from)"
        )
    dataset = cfg.dataset
    # AutoModel's format_prompt_completion (SQuAD, column-mapped instructions without a template)
    if (
        getattr(dataset, "answer_only_loss_mask", False)
        and getattr(dataset, "source", None) in PROMPT_COMPLETION
    ):
        notes.append(
            "dataset.answer_only_loss_mask: the labels are each answer and its EOS; AutoModel 0.7 also labels "
            "the last prompt token of each example where the tokenizer adds a BOS token to a prompt without a "
            "chat template (it counts BOS in the prompt only when tokenizer.add_bos_token is set, which "
            "transformers >= 5.18 drops when tokenizer.json exists)"
        )
    return notes


def startup_notes(cfg: RecipeConfig, raw: dict, *, original: dict | None = None) -> list[str]:
    """The lines for `cfg` (parsed) whose keys `raw` (the translated YAML) leaves out; with the
    file as written (`original`) of one of AutoModel's files, `automodel_file_notes` too."""
    notes = []
    if original is not None and is_automodel_file(original):
        notes += automodel_file_notes(cfg, original)
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
            "also at each ckpt_every_steps step, on all of it; step_scheduler.val_batches: null: all of it here too, "
            "the last batch smaller)"
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
