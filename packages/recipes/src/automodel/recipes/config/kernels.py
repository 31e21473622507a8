"""The ``kernels:`` and ``fp8:`` sections: faster kernels for the same model, both optional extras.

    kernels:
      liger: true        # false (default) | true | auto | a list of Liger patches:
                         #   [rms_norm, rope, swiglu, geglu, layer_norm, fused_linear_cross_entropy]

    fp8:                 # NeMo AutoModel's keys and defaults (torchao float8 training)
      enabled: false
      recipe_name: null  # tensorwise (null) | rowwise | rowwise_with_gw_hp
      enable_fsdp_float8_all_gather: false   # tensorwise + FSDP2: all-gather the weights in float8
      precompute_float8_dynamic_scale_for_fsdp: false   # with it: one scale all-reduce per step
      force_recompute_fp8_weight_in_bwd: false
      filter_fqns: []    # modules whose FQN contains one of these stay in high precision
      emulate: false     # float8 maths emulated in high precision (tests; runs on CPU)

``liger: true`` applies every kernel Liger has for the model's family; a list applies exactly
those and is refused where one cannot be applied; ``auto`` is NeMo AutoModel's
``model.use_liger_kernel: true``: applied where it can run, otherwise one start-up line says why not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from automodel.recipes.config.build import build_section
from automodel.recipes.errors import ConfigError

#: Liger's per-family patch switches this project exposes (each ``apply_liger_kernel_to_<family>``
#: takes a subset); ``fused_linear_cross_entropy`` replaces the chunked loss, not the model's forward.
LIGER_PATCHES = ("rms_norm", "rope", "swiglu", "geglu", "layer_norm", "fused_linear_cross_entropy")
#: torchao's float8 recipes (`Float8LinearRecipeName`); null means tensorwise, as in AutoModel
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass(frozen=True)
class KernelsSection:
    """Which Liger kernels replace the model's own modules (nothing by default)."""

    SECTION: ClassVar[str] = "kernels"
    liger: bool | str | list | tuple = False

    def __post_init__(self) -> None:
        value = self.liger
        if isinstance(value, bool) or value == "auto":
            return
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list | tuple) or not names:
            raise ConfigError(
                "kernels.liger", value, "must be true, false, auto or a non-empty list of patches"
            )
        for name in names:
            if name not in LIGER_PATCHES:
                raise ConfigError(
                    "kernels.liger", value, f"{name!r} is not a Liger patch; use {', '.join(LIGER_PATCHES)}"
                )
        if len(set(names)) != len(names):
            raise ConfigError("kernels.liger", value, "names a patch twice")
        object.__setattr__(self, "liger", tuple(names))

    @property
    def enabled(self) -> bool:
        return self.liger is not False

    @property
    def required(self) -> bool:
        """Whether a Liger kernel that cannot run is refused (true, a list) or said once (auto)."""
        return self.enabled and self.liger != "auto"


#: NeMo AutoModel's ``fp8:`` section as its example recipes write it (llama3_1_8b_hellaswag_fp8.yaml):
#: what the benchmarks' fp8 variants and the fp8 tests run.
AUTOMODEL_EXAMPLE_FP8: dict[str, Any] = {
    "enabled": True,
    "recipe_name": "tensorwise",
    "enable_fsdp_float8_all_gather": True,
    "precompute_float8_dynamic_scale_for_fsdp": True,
    "force_recompute_fp8_weight_in_bwd": True,
    "filter_fqns": ["lm_head"],
    "emulate": False,
}


@dataclass(frozen=True)
class FP8Section:
    """torchao float8 training of the model's linear layers, with NeMo AutoModel's key names."""

    SECTION: ClassVar[str] = "fp8"
    enabled: bool = False
    recipe_name: str | None = None
    enable_fsdp_float8_all_gather: bool = False
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    force_recompute_fp8_weight_in_bwd: bool = False
    filter_fqns: list | tuple = ()
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.recipe_name not in (None, *FP8_RECIPES):
            raise ConfigError("fp8.recipe_name", self.recipe_name, f"must be one of {', '.join(FP8_RECIPES)}")
        fqns = self.filter_fqns
        if not isinstance(fqns, list | tuple) or not all(isinstance(f, str) and f for f in fqns):
            raise ConfigError("fp8.filter_fqns", fqns, "must be a list of module names")
        object.__setattr__(self, "filter_fqns", tuple(fqns))
        if not self.enabled:  # AutoModel reads nothing else then
            return
        if self.enable_fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ConfigError(
                "fp8.enable_fsdp_float8_all_gather",
                True,
                f"works with recipe_name tensorwise only (torchao), not {self.recipe_name}",
            )
        if self.precompute_float8_dynamic_scale_for_fsdp and not self.enable_fsdp_float8_all_gather:
            raise ConfigError(
                "fp8.precompute_float8_dynamic_scale_for_fsdp",
                True,
                "precomputes the scales of the float8 all-gather: it needs enable_fsdp_float8_all_gather: true",
            )

    @property
    def recipe(self) -> str:
        return self.recipe_name or "tensorwise"


def parse_kernels_sections(raw: dict[str, Any]) -> tuple[KernelsSection, FP8Section]:
    """The two sections of the (translated) YAML; absent sections are off."""
    return build_section(KernelsSection, raw.get("kernels")), build_section(FP8Section, raw.get("fp8"))
