"""`RecipeConfig`: the whole YAML as typed, frozen sections (parsed by `recipe_config.parse_recipe_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from automodel.recipes.config.checkpoint import CheckpointConfig
from automodel.recipes.config.distributed import DistributedSection
from automodel.recipes.config.kernels import FP8Section, KernelsSection
from automodel.recipes.config.peft import PeftSection
from automodel.recipes.config.sections import (
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
)
from automodel.recipes.config.trackers import MlflowSection, WandbSection
from automodel.recipes.errors import ConfigError


class DatasetConfig(Protocol):
    """What every dataset kind's section (`data.kinds`) answers: the YAML section it came from
    (``dataset`` / ``validation_dataset``), its ``source`` and its row length."""

    SECTION: ClassVar[str]

    @property
    def source(self) -> str: ...

    @property
    def seq_length(self) -> int: ...


class LossFn(Protocol):
    """``loss_fn``: the SUM of token losses of one micro-batch (the loop divides by the global count)."""

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, /) -> torch.Tensor: ...


@dataclass(frozen=True)
class RecipeConfig:
    model: ModelSection
    dataset: DatasetConfig  # the section of a registered dataset kind (data.kinds)
    validation_dataset: DatasetConfig | None
    tokenizer: TokenizerSection
    step_scheduler: StepSchedulerSection
    optimizer: OptimizerSection
    lr_scheduler: LRSchedulerSection
    loss_fn: LossFn
    distributed: DistributedSection
    packed_sequence: PackedSequenceSection
    checkpoint: CheckpointConfig
    logging: LoggingSection
    dist_env: DistEnvSection
    clip_grad_norm: ClipGradNormSection
    peft: PeftSection | None  # LoRA when the YAML has a peft: section
    seed: int
    output_dir: str
    raw: dict
    dataloader: DataloaderSection = field(default_factory=DataloaderSection)
    validation_dataloader: ValidationDataloaderSection = field(default_factory=ValidationDataloaderSection)
    rng: RngSection = field(default_factory=RngSection)
    kernels: KernelsSection = field(default_factory=KernelsSection)  # Liger's kernels (kernels/)
    fp8: FP8Section = field(default_factory=FP8Section)  # torchao float8 training (kernels/)
    wandb: WandbSection | None = None  # a `wandb:` section (trackers/)
    mlflow: MlflowSection | None = None  # an `mlflow:` section (trackers/)
    #: start-up lines: what this run does differently from NeMo AutoModel (`compat.defaults`)
    notes: tuple[str, ...] = ()
    #: valid settings `recipes train` refuses before launch (`compat.translate.Translation`)
    refusals: tuple[ConfigError, ...] = ()

    @property
    def seq_length(self) -> int:
        return self.packed_sequence.packed_sequence_size or self.dataset.seq_length

    @property
    def seq_length_key(self) -> str:
        """The YAML key `seq_length` comes from, as the user spells it (nanoGPT's is ``seq_len``)."""
        if self.packed_sequence.packed_sequence_size:
            return "packed_sequence.packed_sequence_size"
        return f"dataset.{getattr(type(self.dataset), 'SEQ_LENGTH_KEY', 'seq_length')}"
