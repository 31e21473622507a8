"""LoRA on the meta-device model, before any parallelism is applied.

`apply_lora` swaps every selected ``nn.Linear`` for a `LoRALinear`: the same (frozen) ``weight``
and ``bias`` Parameters under the same FQN, plus ``lora_A`` [dim, in] and ``lora_B`` [out, dim]
``nn.Linear`` children (the names Hugging Face peft uses), so

    y = x W^T + b + dropout(x) A^T B^T * alpha / dim     (dropout_position: pre, as peft)
    y = x W^T + b + dropout(x A^T B^T * alpha / dim)     (dropout_position: post, NeMo's default)

Because it happens on the meta model, every later step composes with it unchanged: the pipeline
split keeps the adapters inside their decoder layers, TP lays them out with their linear's plan
key (`automodel.fsdp2.tp_plan.with_lora_adapters`), FSDP2 shards them in the same units as their frozen
base weights, and materialization initialises them (A: xavier-normal as NeMo AutoModel, B: zeros, so
step 0 equals the base model) from the same (seed, FQN) generators as every other parameter, or
copies both from ``peft.initial_adapter`` (`automodel.recipes.peft.initial`).

MoE experts in transformers 5 are stacked 3-D parameters (``experts.gate_up_proj`` [E, 2I, H]),
not ``nn.Linear`` modules: they cannot carry these adapters, and targeting them is a ConfigError.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from automodel.recipes.config.build import resolve_dtype
from automodel.recipes.config.peft import PeftSection
from automodel.recipes.errors import ConfigError

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_key(fqn: str) -> bool:
    """True for the FQN of a LoRA adapter weight (``<linear>.lora_A.weight`` / ``lora_B``)."""
    return fqn.endswith(ADAPTER_SUFFIXES)


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a frozen base weight and trainable ``lora_A``/``lora_B`` adapters."""

    def __init__(
        self,
        base: nn.Linear,
        *,
        dim: int,
        alpha: float,
        dropout: float = 0.0,
        dropout_position: str = "post",
        lora_A_init: str = "xavier",
        lora_dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)  # keep the base Parameters (on meta): nothing new is allocated for them
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.requires_grad_(False)
        dtype = lora_dtype or base.weight.dtype
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, dim, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(dim, self.out_features, bias=False, device=device, dtype=dtype)
        self.dim = dim
        self.alpha = alpha
        self.scale = float(alpha) / dim
        self.dropout_p = float(dropout)
        self.dropout_position = dropout_position
        self.lora_A_init = lora_A_init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = x if x.dtype == self.lora_A.weight.dtype else x.to(self.lora_A.weight.dtype)
        if self.dropout_p and self.dropout_position == "pre":
            h = F.dropout(h, p=self.dropout_p, training=self.training)
        lora = self.lora_B(self.lora_A(h)) * self.scale
        if self.dropout_p and self.dropout_position == "post":
            lora = F.dropout(lora, p=self.dropout_p, training=self.training)
        return out + lora.to(out.dtype)

    @torch.no_grad()
    def reset_adapters(self, generator: torch.Generator | None = None) -> None:
        """A as `init_adapter_A`, B zeros (on materialized, unsharded adapters)."""
        init_adapter_A(self.lora_A.weight, method=self.lora_A_init, generator=generator)
        self.lora_B.weight.zero_()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_dim={self.dim}, lora_alpha={self.alpha}"


def init_adapter_A(tensor: torch.Tensor, *, method: str, generator: torch.Generator | None = None) -> None:
    """xavier: ``xavier_normal_``; kaiming (``uniform``): peft's ``kaiming_uniform_(a=sqrt(5))``.

    As NeMo AutoModel 0.7's ``LinearLoRA.init_lora_weights``, whose key this is.
    """
    with torch.no_grad():
        if method == "xavier":
            nn.init.xavier_normal_(tensor, generator=generator)
        else:
            nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)


def _glob_regex(pattern: str) -> re.Pattern[str]:
    # NeMo's wildcard rule: ``*`` spans dots; everything else is literal.
    return re.compile("".join(".*" if c == "*" else re.escape(c) for c in pattern))


def pattern_matches(pattern: str, fqn: str) -> bool:
    """A glob over the whole FQN, or over its trailing atoms (``q_proj``, ``self_attn.q_proj``)."""
    rx = _glob_regex(pattern)
    if rx.fullmatch(fqn):
        return True
    atoms = fqn.split(".")
    return any(rx.fullmatch(".".join(atoms[i:])) for i in range(1, len(atoms)))


def _stacked_params(module: nn.Module) -> list[str]:
    return [f"{n} {list(p.shape)}" for n, p in module.named_parameters(recurse=False) if p.dim() >= 3]


def select_linears(model: nn.Module, section: PeftSection) -> list[str]:
    """FQNs of the ``nn.Linear`` modules `section` selects (ConfigError if a pattern selects none,
    or names MoE experts, whose stacked 3-D weights cannot carry these adapters)."""
    modules = dict(model.named_modules())
    linears = [n for n, m in modules.items() if n and isinstance(m, nn.Linear)]
    if section.match_all_linear:
        chosen = linears
    elif section.exclude_modules:
        chosen = [n for n in linears if not any(pattern_matches(p, n) for p in section.exclude_modules)]
    else:
        chosen = []
        for pattern in section.target_modules:
            hits = [n for n in linears if pattern_matches(pattern, n)]
            experts = [(n, _stacked_params(m)) for n, m in modules.items() if n and _stacked_params(m)]
            named_experts = [
                (n, s)
                for n, s in experts
                if pattern_matches(pattern, n)
                or (not hits and any(pattern_matches(pattern, f"{n}.{p.split()[0]}") for p in s))
            ]
            if named_experts:
                n, stacked = named_experts[0]
                raise ConfigError(
                    "peft.target_modules",
                    pattern,
                    f"selects the MoE experts {n} ({', '.join(stacked)}): transformers keeps expert "
                    "weights as stacked 3-D parameters, not nn.Linear modules, so LoRA cannot wrap them. "
                    "Target the attention (and dense MLP) projections instead, e.g. '*_proj'",
                )
            if not hits:
                raise ConfigError(
                    "peft.target_modules",
                    pattern,
                    f"matches no nn.Linear module of {type(model).__name__} (linear modules look like "
                    f"{linears[:3]} ...)",
                )
            chosen += [n for n in hits if n not in chosen]
    if not chosen:
        raise ConfigError("peft", section.exclude_modules, "selects no nn.Linear module to adapt")
    bad = [n for n in chosen if type(modules[n]) is not nn.Linear]
    if bad:
        raise ConfigError(
            "peft.target_modules",
            bad[0],
            f"is a {type(modules[bad[0]]).__name__}, a subclass of nn.Linear with its own forward; "
            "LoRA wraps plain nn.Linear modules only",
        )
    return [n for n in linears if n in set(chosen)]


@dataclass
class LoRAInfo:
    """What `apply_lora` did: the wrapped linears and the settings the PEFT export needs."""

    section: PeftSection
    module_fqns: list[str]
    peft_target_modules: list[str]
    num_adapter_params: int
    num_frozen_params: int


def _peft_target_modules(model: nn.Module, wrapped: list[str]) -> list[str]:
    """Leaf names (``q_proj``) when they select exactly the wrapped linears (peft matches names by
    suffix), else the wrapped FQNs themselves."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in wrapped})
    selected = {
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in leaves
    }
    return leaves if selected == set(wrapped) else list(wrapped)


def apply_lora(model: nn.Module, *, section: PeftSection) -> LoRAInfo:
    """Freeze every parameter of `model` and wrap the selected linears in `LoRALinear` (in place).

    Call on the meta-device model before any parallelism. Returns what was wrapped.
    """
    chosen = select_linears(model, section)
    for param in model.parameters():
        param.requires_grad_(False)
    lora_dtype = None if section.lora_dtype is None else resolve_dtype("peft.lora_dtype", section.lora_dtype)
    for fqn in chosen:
        parent_name, _, leaf = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, leaf)
        setattr(
            parent,
            leaf,
            LoRALinear(
                base,
                dim=section.dim,
                alpha=section.alpha,
                dropout=section.dropout,
                dropout_position=section.dropout_position,
                lora_A_init=section.lora_A_init,
                lora_dtype=lora_dtype,
            ),
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return LoRAInfo(
        section=section,
        module_fqns=chosen,
        peft_target_modules=_peft_target_modules(model, chosen),
        num_adapter_params=trainable,
        num_frozen_params=frozen,
    )


def lora_init_fn(
    base_init: Any, *, section: PeftSection, initial: Mapping[str, torch.Tensor] | None = None
) -> Any:
    """An `automodel.fsdp2` init function: adapters as `LoRALinear.reset_adapters`, the rest as `base_init`.

    `initial`: adapter weights by FQN (``peft.initial_adapter``, `peft.initial`) copied instead of drawn."""

    def init(fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if initial is not None and is_adapter_key(fqn):
            tensor.copy_(initial[fqn])
        elif fqn.endswith(".lora_A.weight"):
            init_adapter_A(tensor, method=section.lora_A_init, generator=generator)
        elif fqn.endswith(".lora_B.weight"):
            tensor.zero_()
        else:
            base_init(fqn, tensor, generator)

    return init


def merged_weight(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """``W + scale * B @ A`` (full tensors), computed in float32, in `weight`'s dtype."""
    delta = (lora_B.float() @ lora_A.float()) * scale
    return (weight.float() + delta).to(weight.dtype)
