"""Checks of a resolved TP plan against the model: every key names a module, every decoder layer is
sharded, and the model's code does not read sharded values in ways the plan cannot honour.

Each rule raises ValueError naming the module and what to do; the recipes run them once on the
meta-device model before launch and the ranks run them again in `apply_tp`.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import RowwiseParallel

from automodel.fsdp2.tp_fqn import decoder_layers_prefix, fqn_matches, removed_by_split
from automodel.fsdp2.tp_styles import LAYOUT_ONLY_STYLES
from automodel.mesh.model_parts import (
    in_other_submodel,
    model_text_config,
    other_submodel_prefixes,
    positive_ints,
)


def check_plan_matches_model(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Raise ValueError for plan keys that match no submodule (torch would only warn); on a
    pipeline stage, keys of modules other stages hold are not checked here (the whole model's
    check before launch covers them)."""
    fqns = [n for n, _ in model.named_modules() if n]
    missing = [k for k in plan if not any(fqn_matches(k, n) for n in fqns) and not removed_by_split(model, k)]
    if missing:
        raise ValueError(
            f"tp_plan keys {missing} match no submodule of {type(model).__name__} "
            f"(module names look like {fqns[:4]}...)"
        )


def _check_embedding_input_layout(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Rule: a row-wise style on an nn.Embedding must take its token ids whole (Replicate, the
    ``embedding_rowwise`` style); plain ``rowwise`` reads them as split on the last dim, so every
    rank would embed a sequence tp times too long (Llama crashed in its rotary embedding)."""
    names = dict(model.named_modules())
    for key, style in plan.items():
        if not isinstance(style, RowwiseParallel) or style.input_layouts == (Replicate(),):
            continue
        embeddings = [f for f, m in names.items() if isinstance(m, nn.Embedding) and fqn_matches(key, f)]
        if embeddings:
            raise ValueError(
                f"tp_plan[{key!r}] is a row-wise style whose input is split on its last dim, but "
                f"{embeddings[0]} is an nn.Embedding, whose input is the token ids; use 'embedding_rowwise'"
            )


def _check_sharded_embeddings_read_only_by_lookup(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Rule: a vocab-sharded embedding (rowwise) is correct through its own lookup only. Model code
    that reads its weight directly (Gemma 4's multimodal forward takes the pad token's row,
    ``embed_tokens.weight[pad_id]``) would get a shard of the table (crashed mixing Tensor and
    DTensor). Found by reading the forwards' source for ``<embedding name>.weight``."""
    names = dict(model.named_modules())
    for key, style in plan.items():
        if type(style) is not RowwiseParallel:
            continue
        for fqn, module in names.items():
            if not isinstance(module, nn.Embedding) or not fqn_matches(key, fqn):
                continue
            attribute = fqn.rpartition(".")[2]
            # its values, not its device, dtype or (global) shape, which a DTensor reports alike
            reads = re.compile(rf"\b{re.escape(attribute)}\.weight\b(?!\.(device|dtype|shape)\b)")
            readers = sorted(
                {
                    type(m).__name__
                    for m in names.values()
                    if type(m) is not type(module) and reads.search(_forward_source(type(m)) or "")
                }
            )
            if readers:
                raise ValueError(
                    f"{fqn} would be split over tp by vocabulary rows, but {', '.join(readers)} reads "
                    f"{attribute}.weight directly (not through the lookup) and would get a shard of it; "
                    "give an explicit tp_plan that keeps the embedding whole"
                )


def _forward_source(cls: type) -> str | None:
    if cls.forward is nn.Module.forward or cls.__module__.startswith("torch."):
        return None
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def _check_no_statistics_over_sharded_mlp(config: object, sharding: list[str]) -> None:
    """Rule: a colwise MLP projection leaves each rank a slice of the intermediate width, so an MLP
    that computes statistics across that width (Gemma 3n's activation sparsity: a Gaussian top-k
    from the mean and deviation of the gate activations) would compute them per slice (measured:
    5e-2 off one process)."""
    sparsity = getattr(config, "activation_sparsity_pattern", None) or ()
    if any(float(s) > 0 for s in sparsity) and any(
        k.endswith(("mlp.gate_proj", "mlp.up_proj")) for k in sharding
    ):
        raise ValueError(
            f"config.activation_sparsity_pattern={list(sparsity)}: the MLP keeps the top activations by "
            "statistics over its whole intermediate width, which the tensor-parallel plan splits over ranks; "
            "give an explicit tp_plan that leaves the MLP whole"
        )


def check_plan_shards_every_layer(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """ValueError unless the plan really parallelizes every decoder layer of `model`.

    Two ways a resolved plan can silently leave the math as one process while looking applied:
    a decoder layer no sharding key reaches (the model's plan covers only some layers, e.g. only
    the MoE ones), and a per-head parameter (a per-head norm weight, attention sinks) left whole
    in an attention module whose projections are sharded by heads.
    """
    found = decoder_layers_prefix(model)
    if found is None:
        return
    prefix = found[0]
    sharding = [k for k, style in plan.items() if not isinstance(style, LAYOUT_ONLY_STYLES)]
    names = [n for n, _ in model.named_modules()]
    config = model_text_config(model)
    _check_no_statistics_over_sharded_mlp(config, sharding)
    _check_embedding_input_layout(model, plan)
    _check_sharded_embeddings_read_only_by_lookup(model, plan)
    heads = {v for k in ("num_attention_heads", "num_key_value_heads") for v in positive_ints(config, k)} - {
        1
    }

    def covered(fqn: str) -> bool:
        atoms = fqn.split(".")
        return any(fqn_matches(k, ".".join(atoms[:n])) for k in sharding for n in range(1, len(atoms) + 1))

    layers = sorted({n[len(prefix) + 1 :].split(".", 1)[0] for n in names if n.startswith(prefix + ".")})
    untouched = [i for i in layers if not any(covered(n) for n in names if n.startswith(f"{prefix}.{i}."))]
    if untouched:
        raise ValueError(
            f"the tensor-parallel plan shards nothing in decoder layers {untouched} of {type(model).__name__} "
            f"(plan keys: {sorted(plan)}); tp would leave them replicated. Give an explicit tp_plan"
        )
    for name, module in model.named_modules():
        if not name.startswith(prefix + ".") or not name.rpartition(".")[2].endswith(("attn", "attention")):
            continue
        if not any(covered(n) for n, _ in module.named_modules(prefix=name)):
            continue  # attention not sharded by the plan: nothing split by heads here
        for pname, param in module.named_parameters(prefix=name):
            owner = pname.rpartition(".")[0]
            if not covered(owner) and param.dim() >= 1 and param.shape[0] in heads:
                raise ValueError(
                    f"{pname} holds one entry per attention head (shape {tuple(param.shape)}) but the "
                    "tensor-parallel plan shards the heads and not it; give an explicit tp_plan that lays it out"
                )


def validate_tp_mesh(model: nn.Module, tp_mesh: DeviceMesh | int) -> None:
    """Attention heads and KV heads must be divisible by the TP size (each rank owns whole heads)."""
    tp = tp_mesh if isinstance(tp_mesh, int) else tp_mesh.size()
    if tp == 1:
        return
    config = model_text_config(model)
    for key in ("num_attention_heads", "num_key_value_heads"):
        for value in positive_ints(config, key):
            if value % tp != 0:
                raise ValueError(
                    f"{key}={value} is not divisible by tp_size={tp}; pick a tp_size that divides it"
                )


def check_sequence_parallel_applies(model: nn.Module) -> None:
    """Rule: under SP the hidden states between the layers are sequence shards, laid out only by the
    plan's modules. A parameter a container module holds itself (not in a submodule the plan can
    lay out, e.g. HRM's ``z_L_init`` initial state added to the hidden states) stays a whole plain
    tensor that the forward mixes with those shards, so the SP plan cannot apply."""
    towers = other_submodel_prefixes(model)  # a vision tower does not run in text training
    own = [
        f"{name}.{p}" if name else p
        for name, module in model.named_modules()
        # containers outside the layers (inside a layer, the plan's own modules hold the weights)
        if any(True for _ in module.children())
        and not any(part.isdigit() for part in name.split("."))
        and not in_other_submodel(name, towers)
        for p, _ in module.named_parameters(recurse=False, remove_duplicate=False)
    ]
    if own:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"sequence parallel: model_type {model_type!r} holds parameters {own[:3]} in container modules "
            "(outside any module the sequence-parallel plan lays out), which its forward combines with the "
            "sequence-sharded hidden states; use tensor parallelism without sequence_parallel"
        )
