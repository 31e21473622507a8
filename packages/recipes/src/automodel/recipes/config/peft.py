"""`PeftSection`: the YAML ``peft:`` section (LoRA), with NeMo AutoModel's key names and defaults.

    peft:
      target_modules: ["*_proj"]   # globs over module FQNs (``*`` spans dots) or module names
      exclude_modules: []          # or: every linear except these
      match_all_linear: false      # or: every nn.Linear, lm_head included
      dim: 8                       # LoRA rank r
      alpha: 32                    # scale = alpha / dim
      dropout: 0.0
      dropout_position: post       # post: dropout on the LoRA output (NeMo); pre: on its input (peft)
      lora_A_init: xavier          # xavier: xavier_normal_ (NeMo AutoModel's default); kaiming / uniform: peft's init
      lora_dtype: null             # adapter dtype; null: the base weight's
      save_merged: false           # also write consolidated/ with the adapters merged into the weights
      initial_adapter: null        # ours alone: start from this HF PEFT adapter directory, not a fresh draw

Nothing set selects ``target_modules: ["*_proj"]`` (NeMo's default). ``target_modules``,
``exclude_modules`` and ``match_all_linear`` are mutually exclusive, as in NeMo.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from automodel.recipes.config.build import resolve_dtype
from automodel.recipes.errors import ConfigError

DROPOUT_POSITIONS = ("pre", "post")
LORA_A_INITS = ("kaiming", "uniform", "xavier")


def _str_list(key: str, value: object) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(key, value, "must be a module name/glob or a list of them")
    return list(value)


@dataclass(frozen=True)
class PeftSection:
    """LoRA on the linears `target_modules` selects; base weights frozen, adapters trained."""

    SECTION: ClassVar[str] = "peft"
    target_modules: list | str = field(default_factory=list)
    exclude_modules: list | str = field(default_factory=list)
    match_all_linear: bool = False
    dim: int = 8
    alpha: int | float = 32
    dropout: float = 0.0
    dropout_position: str = "post"
    lora_A_init: str = "xavier"  # NeMo AutoModel 0.7's PeftConfig default (xavier_normal_)
    lora_dtype: str | None = None
    save_merged: bool = False
    #: A Hugging Face PEFT adapter directory to start from (`peft.initial`); a key of this project's
    #: only (AutoModel 0.7's PeftConfig has none). Null: A drawn as lora_A_init says, B zeros.
    initial_adapter: str | None = None

    def __post_init__(self) -> None:
        s = self.SECTION
        object.__setattr__(self, "target_modules", _str_list(f"{s}.target_modules", self.target_modules))
        object.__setattr__(self, "exclude_modules", _str_list(f"{s}.exclude_modules", self.exclude_modules))
        for key in ("match_all_linear", "save_merged"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{s}.{key}", getattr(self, key), "must be true or false")
        if self.target_modules and self.exclude_modules:
            raise ConfigError(
                f"{s}.exclude_modules",
                self.exclude_modules,
                "cannot be combined with peft.target_modules (give one of them)",
            )
        if self.match_all_linear and (self.target_modules or self.exclude_modules):
            which = "target_modules" if self.target_modules else "exclude_modules"
            raise ConfigError(
                f"{s}.match_all_linear", True, f"cannot be combined with peft.{which} (give one of them)"
            )
        if not (self.match_all_linear or self.target_modules or self.exclude_modules):
            object.__setattr__(self, "target_modules", ["*_proj"])
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ConfigError(f"{s}.dim", self.dim, "must be an int >= 1")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or self.alpha <= 0:
            raise ConfigError(f"{s}.alpha", self.alpha, "must be a number > 0")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, int | float)
            or not 0.0 <= self.dropout < 1.0
        ):
            raise ConfigError(f"{s}.dropout", self.dropout, "must be a number in [0, 1)")
        if self.dropout_position not in DROPOUT_POSITIONS:
            raise ConfigError(f"{s}.dropout_position", self.dropout_position, "must be pre or post")
        if self.lora_A_init not in LORA_A_INITS:
            raise ConfigError(
                f"{s}.lora_A_init", self.lora_A_init, f"must be one of {', '.join(LORA_A_INITS)}"
            )
        if self.lora_dtype is not None:
            resolve_dtype(f"{s}.lora_dtype", self.lora_dtype)
        if self.initial_adapter is not None and (
            not isinstance(self.initial_adapter, str) or not self.initial_adapter
        ):
            raise ConfigError(
                f"{s}.initial_adapter", self.initial_adapter, "must be the path of a PEFT adapter directory"
            )

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.dim
