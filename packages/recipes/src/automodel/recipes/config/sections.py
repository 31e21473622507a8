"""Typed, validated dataclasses for every section of a recipe YAML (except `distributed:`).

Each section is frozen and checks its own keys in `__post_init__` (reading no disk: what needs this
machine is `preflight`'s, run by `launch_check.check_launch`), raising `ConfigError` naming
``section.key`` and the bad value; cross-section rules live in `recipe_config.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from automodel.recipes.config.build import build_section as build_section  # every section is built by it
from automodel.recipes.config.build import positive, resolve_dtype
from automodel.recipes.errors import ConfigError


@dataclass(frozen=True)
class ModelSection:
    """A transformers architecture from a config dict (built on meta), or a local HF directory."""

    SECTION: ClassVar[str] = "model"
    config: dict | None = None
    # A local HF directory or a Hub id resolved through the local HF cache (never downloaded).
    pretrained_model_name_or_path: str | None = None
    pretrained_path: str | None = None  # alias of pretrained_model_name_or_path (the 0.1 name)
    dtype: str = "float32"
    # auto: sdpa where the model supports it, else eager (see model.resolve_attn_implementation)
    attn_implementation: str = "auto"
    # Security: a model directory is data. Its Python files (config.json auto_map) run only with
    # trust_remote_code: true; pickled weights (*.bin) load only with allow_pickle_weights: true.
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False
    # Fields set on the pretrained model's config.json before it is built (each checked against its
    # config class, as model.config's keys): AutoModel's from_pretrained(config=...) overrides.
    config_overrides: dict | None = None

    def __post_init__(self) -> None:
        for key in ("trust_remote_code", "allow_pickle_weights"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"model.{key}", getattr(self, key), "must be true or false")
        if self.config_overrides is not None:
            if not isinstance(self.config_overrides, dict) or not all(
                isinstance(k, str) for k in self.config_overrides
            ):
                raise ConfigError(
                    "model.config_overrides", self.config_overrides, "must be a mapping of keys"
                )
            if self.config is not None:
                raise ConfigError(
                    "model.config_overrides",
                    self.config_overrides,
                    "applies to a pretrained model's config; with model.config, put the keys there",
                )
        if self.pretrained_model_name_or_path is not None and self.pretrained_path is not None:
            raise ConfigError(
                "model.pretrained_path",
                self.pretrained_path,
                "is an alias of model.pretrained_model_name_or_path; set only one of them",
            )
        for key in ("pretrained_model_name_or_path", "pretrained_path"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"model.{key}", value, "must be a local directory or a Hub id (org/name)")
        if (self.config is None) == (self.pretrained_source is None):
            raise ConfigError(
                "model",
                self.config or self.pretrained_source,
                "set exactly one of model.config and model.pretrained_model_name_or_path "
                "(alias model.pretrained_path)",
            )
        if self.config is not None and "model_type" not in self.config:
            raise ConfigError("model.config.model_type", None, "is required (e.g. llama, qwen3, mixtral)")

        # one spelling downstream (bf16, torch.bfloat16, BFloat16 -> bfloat16): the one parser decides
        object.__setattr__(
            self, "dtype", str(resolve_dtype("model.dtype", self.dtype)).removeprefix("torch.")
        )
        if self.attn_implementation not in ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention"):
            raise ConfigError(
                "model.attn_implementation",
                self.attn_implementation,
                "must be auto, sdpa, eager, flash_attention_2 or flex_attention",
            )

    @property
    def pretrained_source(self) -> str | None:
        """What the YAML names: ``pretrained_model_name_or_path`` or its alias ``pretrained_path``."""
        return self.pretrained_model_name_or_path or self.pretrained_path

    @property
    def pretrained_key(self) -> str:
        """The YAML key that names the pretrained model (for error messages)."""
        if self.pretrained_model_name_or_path is not None:
            return "model.pretrained_model_name_or_path"
        return "model.pretrained_path"


@dataclass(frozen=True)
class TokenizerSection:
    """Byte-level (vocab 256, EOS = byte 0) by default, or a local HF tokenizer directory."""

    SECTION: ClassVar[str] = "tokenizer"
    path: str | None = None
    # A local directory or a Hub id from the local HF cache. With neither key, a pretrained model's
    # own tokenizer files are used (the byte tokenizer when its directory has none).
    pretrained_model_name_or_path: str | None = None
    trust_remote_code: bool = False  # run Python files of the tokenizer directory (auto_map)
    # AutoModel's keys. add_bos_token: BOS before each plain-text example (checked on the loaded
    # tokenizer; None: its own setting). add_eos_token: every example and document ends with EOS here.
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.trust_remote_code, bool):
            raise ConfigError("tokenizer.trust_remote_code", self.trust_remote_code, "must be true or false")
        for key in ("add_bos_token", "add_eos_token"):
            if getattr(self, key) not in (None, True, False):
                raise ConfigError(f"tokenizer.{key}", getattr(self, key), "must be true or false")
        if self.add_eos_token is False:
            raise ConfigError(
                "tokenizer.add_eos_token",
                False,
                "every example and document ends with EOS here (its label ends the answer); only true",
            )
        if self.path is not None and self.pretrained_model_name_or_path is not None:
            raise ConfigError(
                "tokenizer.pretrained_model_name_or_path",
                self.pretrained_model_name_or_path,
                "names the tokenizer like tokenizer.path; set only one of them",
            )


@dataclass(frozen=True)
class StepSchedulerSection:
    """Batch sizes and step counts; grad accumulation = global / (local * dp)."""

    SECTION: ClassVar[str] = "step_scheduler"
    global_batch_size: int = 8
    local_batch_size: int = 1
    max_steps: int | None = None
    num_epochs: int = 1
    val_every_steps: int | None = None
    ckpt_every_steps: int | None = None
    val_batches: int | None = 2  # global batches per validation; None: all of validation_dataset
    gc_every_steps: int | None = None  # gc.collect() every N steps (AutoModel's key; None: never)
    save_checkpoint_every_epoch: bool = False  # also a checkpoint at each epoch's last step (AutoModel's key)

    def __post_init__(self) -> None:
        s = self.SECTION
        for name in ("global_batch_size", "local_batch_size", "num_epochs"):
            positive(s, name, getattr(self, name))
        for name in ("max_steps", "val_every_steps", "ckpt_every_steps", "gc_every_steps", "val_batches"):
            positive(s, name, getattr(self, name), allow_none=True)
        if not isinstance(self.save_checkpoint_every_epoch, bool):
            raise ConfigError(
                f"{s}.save_checkpoint_every_epoch", self.save_checkpoint_every_epoch, "must be true or false"
            )
        if self.global_batch_size % self.local_batch_size != 0:
            raise ConfigError(
                f"{s}.global_batch_size",
                self.global_batch_size,
                f"must be a multiple of local_batch_size={self.local_batch_size}",
            )


@dataclass(frozen=True)
class LRSchedulerSection:
    """NeMo AutoModel's schedule: linear warm-up from `init_lr`, then cosine / linear decay to
    `min_lr` (or constant). Unset keys take AutoModel's defaults, resolved against the run's LR and
    length in `lr_schedule`: warm-up min(1000, total steps // 10), init_lr 0.1 x LR, min_lr
    0.01 x LR. No ``lr_scheduler:`` section at all is a constant LR (`CONSTANT`), as in AutoModel.
    ``lr_warmup_steps`` / ``lr_decay_style`` (AutoModel's names) are read as these keys."""

    SECTION: ClassVar[str] = "lr_scheduler"
    warmup_steps: int | None = None
    decay_style: str = "cosine"
    decay_steps: int | None = None  # after the warm-up (default: the rest of the run)
    min_lr: float | None = None
    init_lr: float | None = None

    def __post_init__(self) -> None:
        s = self.SECTION
        positive(s, "warmup_steps", self.warmup_steps, minimum=0, allow_none=True)
        positive(s, "decay_steps", self.decay_steps, allow_none=True)
        if self.decay_style not in ("cosine", "linear", "constant"):
            raise ConfigError(f"{s}.decay_style", self.decay_style, "must be cosine, linear or constant")
        for key in ("min_lr", "init_lr"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ConfigError(f"{s}.{key}", value, "must be >= 0")


#: the schedule of a config without an ``lr_scheduler:`` section (AutoModel builds none)
CONSTANT_LR = LRSchedulerSection(warmup_steps=0, decay_style="constant")


@dataclass(frozen=True)
class PackedSequenceSection:
    """Rows of `packed_sequence_size` tokens whose position ids restart at each document (0 = off)."""

    SECTION: ClassVar[str] = "packed_sequence"
    packed_sequence_size: int = 0
    max_packs: int | None = None  # only the first N packed rows, train and validation (AutoModel's key)

    def __post_init__(self) -> None:
        positive(self.SECTION, "packed_sequence_size", self.packed_sequence_size, minimum=0)
        positive(self.SECTION, "max_packs", self.max_packs, allow_none=True)
        if self.max_packs is not None and self.packed_sequence_size == 0:
            raise ConfigError("packed_sequence.max_packs", self.max_packs, "needs packed_sequence_size > 0")
        if 0 < self.packed_sequence_size < 2:
            raise ConfigError(
                "packed_sequence.packed_sequence_size", self.packed_sequence_size, "must be 0 or >= 2"
            )


@dataclass(frozen=True)
class ClipGradNormSection:
    SECTION: ClassVar[str] = "clip_grad_norm"
    max_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if self.max_norm is not None and self.max_norm <= 0:
            raise ConfigError("clip_grad_norm.max_norm", self.max_norm, "must be > 0 (or null to disable)")


LAYOUT_REPORTS = ("none", "rank0", "all")


@dataclass(frozen=True)
class LoggingSection:
    """Progress bar, TensorBoard, and which ranks write ``layout/rank_<N>.json`` (what each rank holds)."""

    SECTION: ClassVar[str] = "logging"
    progress_bar: bool = True
    tensorboard: bool = False
    layout_report: str = "rank0"

    def __post_init__(self) -> None:
        if self.layout_report not in LAYOUT_REPORTS:
            raise ConfigError(
                "logging.layout_report", self.layout_report, f"must be one of {', '.join(LAYOUT_REPORTS)}"
            )


@dataclass(frozen=True)
class DistEnvSection:
    """Process-group settings: backend (auto: nccl with CUDA, else gloo) and collective time-out."""

    SECTION: ClassVar[str] = "dist_env"
    backend: str | None = None
    timeout_minutes: float = 10.0

    def __post_init__(self) -> None:
        if self.backend not in (None, "nccl", "gloo"):
            raise ConfigError("dist_env.backend", self.backend, "must be nccl or gloo (or null for auto)")
        if self.timeout_minutes <= 0:
            raise ConfigError("dist_env.timeout_minutes", self.timeout_minutes, "must be > 0")


@dataclass(frozen=True)
class OptimizerSection:
    """`_target_` of a torch optimizer class plus its keyword arguments (params are passed in)."""

    SECTION: ClassVar[str] = "optimizer"
    target: str = "torch.optim.AdamW"
    kwargs: dict = field(default_factory=lambda: {"lr": 1e-3})


COLLATES = ("pad", "packed")


@dataclass(frozen=True)
class DataloaderSection:
    """``dataloader:`` / ``validation_dataloader:`` (NeMo AutoModel's keys; its ``_target_`` and
    ``collate_fn`` are mapped by `compat.translate`).

    ``shuffle`` (default true, as AutoModel): a seeded permutation per epoch, else dataset order.
    Rows are tensors in memory here, so ``num_workers``, ``pin_memory`` and ``pad_seq_len_divisible``
    change no batch; ``batch_size`` must be the micro-batch (``step_scheduler.local_batch_size``)
    or null; validation batches are averaged per token, so its batch size changes no number.
    """

    SECTION: ClassVar[str] = "dataloader"
    shuffle: bool = True
    num_workers: int = 0
    batch_size: int | None = None
    collate: str = "pad"  # from collate_fn: pad (default_collater) or packed (packed_sequence_thd_collater)
    pad_seq_len_divisible: int | None = None
    drop_last: bool = True
    pin_memory: bool = False
    persistent_workers: bool = False
    dataloader_type: str = "single"

    def __post_init__(self) -> None:
        s = self.SECTION
        positive(s, "num_workers", self.num_workers, minimum=0)
        positive(s, "batch_size", self.batch_size, allow_none=True)
        positive(s, "pad_seq_len_divisible", self.pad_seq_len_divisible, allow_none=True)
        if self.collate not in COLLATES:
            raise ConfigError(f"{s}.collate", self.collate, f"must be one of {', '.join(COLLATES)}")
        if self.dataloader_type != "single":
            raise ConfigError(f"{s}.dataloader_type", self.dataloader_type, "only single is supported")


@dataclass(frozen=True)
class ValidationDataloaderSection(DataloaderSection):
    SECTION: ClassVar[str] = "validation_dataloader"
    shuffle: bool = False


@dataclass(frozen=True)
class RngSection:
    """``rng:`` (AutoModel's StatefulRNG; its ``seed`` is the top-level ``seed``). ``ranked``: after
    the model is built, each data-parallel rank seeds torch with ``seed + dp rank`` (dropout masks
    differ across replicas; TP/CP/PP ranks of one replica share them, as their tensors must)."""

    SECTION: ClassVar[str] = "rng"
    ranked: bool = True
