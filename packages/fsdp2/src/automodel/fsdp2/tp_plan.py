"""Tensor-parallel plan resolution: HF plan strings -> torch ``ParallelStyle`` objects.

Resolution order (`resolve_tp_plan`): an explicit plan (dict, or import path of a dict or of a
function returning one) -> the model's own Hugging Face plan (`get_hf_tp_shard_plan`) -> a
Llama-style default built from the module names the model actually has. With sequence parallel
and no explicit plan the Llama-style SP plan is used (HF plans carry no SP entries).

Reused by the megatron-fsdp adapter; depends on torch only (transformers is never imported).
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import inspect
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from automodel.fsdp2.hf_config import head_dims, positive_ints
from automodel.fsdp2.tp_shared_styles import (
    RowwiseOwnedOutput,
    SharedTailParallel,
    replicated_on_sharded_width,
)
from automodel.fsdp2.utils import import_class_from_path
from automodel.mesh.model_parts import (
    find_layer_list,
    in_other_submodel,
    model_text_config,
    other_submodel_prefixes,
    tied_weight_modules,
)

logger = logging.getLogger(__name__)

TPPlan = dict[str, ParallelStyle]

#: HF styles with a DTensor equivalent, and what they become.
_STYLE_FACTORIES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    # Rowwise outputs stay ordinary tensors: some models update them in place (RowwiseOwnedOutput).
    "rowwise": RowwiseOwnedOutput,
    "local_colwise": ColwiseParallel,
    "local_rowwise": RowwiseOwnedOutput,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
    # A replicated module fed head-sharded activations (e.g. Qwen3 q_norm/k_norm after a colwise
    # q_proj): its weight grad is a partial sum over TP ranks, which DTensor all-reduces.
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True),
}
#: HF styles we know but do not translate: expert/packed/EP styles belong to automodel.moe.
_UNSUPPORTED_STYLES = {
    "packed_colwise": "packed (fused) projections need a strided shard; give an explicit plan",
    "packed_rowwise": "packed (fused) projections need a strided shard; give an explicit plan",
    "local_packed_rowwise": "packed (fused) projections need a strided shard; give an explicit plan",
    "moe_tp_experts": "MoE experts are parallelized by automodel.moe (EP)",
    "moe_identity_expert": "MoE experts are parallelized by automodel.moe (EP)",
    "grouped_gemm": "an expert-parallel (EP) style; use automodel.moe",
    "ep_dispatch_experts": "an expert-parallel (EP) style; use automodel.moe",
    "mla_kv_a_proj": "needs the rope width of the model; a model's own HF plan resolves it",
    "all_reduce": "a module-output all-reduce of HF's own TP engine",
    "local_params": "HF's manual local-parameter mode",
    "local": "HF's manual local-tensor mode",
    "replicate": "HF's replicate marker (nothing to shard)",
}
#: Styles that `get_hf_tp_shard_plan` leaves out (the module stays replicated: correct, not sharded).
_SKIPPED_IN_HF_PLAN = set(_UNSUPPORTED_STYLES) - {"mla_kv_a_proj"}


def translate_to_torch_parallel_style(style: str) -> ParallelStyle:
    """Translate one HF plan string (``"colwise"``, ``"embedding_rowwise"``, ...) to a torch style."""
    if not isinstance(style, str):
        raise ValueError(f"tensor-parallel style must be a string, got {style!r}")
    factory = _STYLE_FACTORIES.get(style)
    if factory is not None:
        return factory()
    if style in _UNSUPPORTED_STYLES:
        raise ValueError(
            f"tensor-parallel style {style!r} is not supported by automodel.fsdp2: {_UNSUPPORTED_STYLES[style]}"
        )
    raise ValueError(
        f"unknown tensor-parallel style {style!r}; known styles: {', '.join(sorted(_STYLE_FACTORIES))}"
    )


def get_hf_tp_shard_plan(model: nn.Module) -> TPPlan:
    """The model's own Hugging Face TP plan, translated to torch styles.

    Merges the class ``_tp_plan``, the inner base model's plan and ``config.base_model_tp_plan``
    (prefixed with ``base_model_prefix``), then the instance ``_tp_plan`` (transformers 5 fills it
    with the prefixed base plan and ``embedding_rowwise`` for untied embeddings). Expert/EP and
    packed styles are left out (those modules stay replicated), and so are keys for modules this
    instance does not have (variant entries of a generic plan). Raises ValueError if no plan exists.
    """
    raw: dict[str, str] = {}
    raw.update(getattr(type(model), "_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "") or ""
    inner = getattr(model, prefix, None) if prefix else None
    config = model_text_config(model)
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if isinstance(inner, nn.Module):
        base_plan.update(getattr(inner, "_tp_plan", None) or {})
        raw.update({f"{prefix}.{k}": v for k, v in base_plan.items()})
    else:
        # A wrapper without base_model_prefix (e.g. a pipeline stage holding `model.layers`): the
        # base plan is relative to the module that owns the decoder layers.
        found = _layers_prefix(model)
        base = found[0].rpartition(".")[0] if found is not None else ""
        raw.update({f"{base}.{k}" if base else k: v for k, v in base_plan.items()})
    instance_plan = model.__dict__.get("_tp_plan") or {}
    raw.update(instance_plan)
    if not raw:
        raise ValueError(
            f"{type(model).__name__} has no Hugging Face tensor-parallel plan (_tp_plan / base_model_tp_plan)"
        )
    plan: TPPlan = {}
    modules = [n for n, _ in model.named_modules() if n]
    for key, style in raw.items():
        if style in _SKIPPED_IN_HF_PLAN:
            logger.info("TP plan: leaving %s (%s) replicated", key, style)
            continue
        if _resolves_to_parameter(model, key):
            logger.info("TP plan: %s names a parameter, not a module; left replicated", key)
            continue
        if not any(_fqn_matches(key, n) for n in modules):
            # HF plans cover every variant of an architecture (e.g. Qwen3-MoE's dense `mlp.*_proj`
            # for `mlp_only_layers`); a key this instance has no module for is not an error.
            logger.info("TP plan: %s matches no module of this model; skipped", key)
            continue
        plan[key] = (
            _mla_kv_a_style(config) if style == "mla_kv_a_proj" else translate_to_torch_parallel_style(style)
        )
    plan.update(_activations_between(model, plan))
    plan.update(_head_norms_between(model, plan))
    return plan


def _mla_kv_a_style(config: Any) -> ParallelStyle:
    """Multi-head latent attention's ``kv_a_proj_with_mqa`` ([latent | rope key shared by all heads]):
    replicated, with the rope key's gradient summed over tp (each rank's heads use it)."""
    width = getattr(config, "qk_rope_head_dim", None)
    if not isinstance(width, int) or width <= 0:
        raise ValueError(
            f"the plan style 'mla_kv_a_proj' needs config.qk_rope_head_dim, {type(config).__name__} has {width!r}"
        )
    return SharedTailParallel(width)


def _activations_between(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> TPPlan:
    """Plan entries for parameterized activations between a colwise and a rowwise linear.

    In a feed-forward block whose only linears are sharded (colwise in, rowwise out), a child with
    parameters that is not in the plan (xIELU's learned ``alpha_p``/``alpha_n``) runs on the
    width-sharded activation, so its parameter gradients are partial sums over tp: it is laid out
    by `replicated_on_sharded_width`. Only parameters that broadcast over the features qualify
    (one value per feature would have to be sharded instead); attention blocks are left alone.
    """
    extra: TPPlan = {}
    parents = {
        k.rpartition(".")[0] for k, v in plan.items() if type(v) in (RowwiseParallel, RowwiseOwnedOutput)
    }
    for parent_key in parents:
        children = {k.rpartition(".")[2]: v for k, v in plan.items() if k.rpartition(".")[0] == parent_key}
        if not any(type(v) is ColwiseParallel for v in children.values()):
            continue
        for name, parent in model.named_modules():
            if not _fqn_matches(parent_key, name) or name.rpartition(".")[2].endswith(("attn", "attention")):
                continue
            unplanned = [(c, m) for c, m in parent.named_children() if c not in children]
            if any(isinstance(m, nn.Linear) for _, m in unplanned):
                continue  # a replicated linear in the block: its activations are not all sharded
            for child, module in unplanned:
                params = list(module.parameters())
                if params and all(p.dim() == 0 or p.shape[-1] == 1 for p in params):
                    extra[f"{parent_key}.{child}"] = replicated_on_sharded_width()
    return extra


def _keeps_heads_sharded(style: ParallelStyle) -> bool:
    """A colwise style whose output stays split over tp (not gathered back to every rank)."""
    return type(style) is ColwiseParallel and any(isinstance(p, Shard) for p in style.output_layouts)


def _head_norms_between(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> TPPlan:
    """Plan entries for per-head norms an attention block's plan leaves out.

    In an attention block whose projections are sharded by heads (colwise, output kept split), a child whose
    parameters are all one head_dim-wide vector shared by every head (a q/k norm the model's own
    plan omits because its config turns it off by default: GLM-4-MoE ``use_qk_norm``) runs on this
    rank's heads only, so its gradient is a partial sum over tp: it is laid out like Qwen3's
    q_norm (``replicated_with_grad_allreduce``).
    """
    widths = {(hd,) for hd in head_dims(model_text_config(model))}
    if not widths:
        return {}
    extra: TPPlan = {}
    parents = {k.rpartition(".")[0] for k, v in plan.items() if _keeps_heads_sharded(v)}
    for parent_key in parents:
        if not parent_key.rpartition(".")[2].endswith(("attn", "attention")):
            continue
        if any(
            type(v) is ColwiseParallel and not _keeps_heads_sharded(v)
            for k, v in plan.items()
            if k.rpartition(".")[0] == parent_key
        ):
            continue  # a gathered projection (MiniMax-M3's colwise_gather_output): every rank has all heads
        planned = {k.rpartition(".")[2] for k in plan if k.rpartition(".")[0] == parent_key}
        for name, parent in model.named_modules():
            if not _fqn_matches(parent_key, name):
                continue
            for child, module in parent.named_children():
                params = list(module.parameters())
                if child in planned or not params or isinstance(module, nn.Linear):
                    continue
                if all(tuple(p.shape) in widths for p in params):
                    extra[f"{parent_key}.{child}"] = translate_to_torch_parallel_style(
                        "replicated_with_grad_allreduce"
                    )
    return extra


def _resolves_to_parameter(model: nn.Module, key: str) -> bool:
    names = [n for n, _ in model.named_parameters()]
    return any(_fqn_matches(key, n) for n in names) and not any(
        _fqn_matches(key, n) for n, _ in model.named_modules()
    )


def _fqn_matches(pattern: str, fqn: str) -> bool:
    """parallelize_module's matching rule: same number of atoms, fnmatch atom by atom."""
    pat, name = pattern.split("."), fqn.split(".")
    return len(pat) == len(name) and all(fnmatch.fnmatch(n, p) for p, n in zip(pat, name))


def _removed_by_split(model: nn.Module, pattern: str) -> bool:
    """Whether `pattern` leads through a module slot a pipeline split emptied (set to None, as
    the stages before the last hold ``lm_head`` and the final norm): that key names a module
    another stage holds, not a typo."""
    node: Any = model
    for atom in pattern.split("."):
        if any(c in atom for c in "*?["):
            return False
        if atom in getattr(node, "_modules", {}) and node._modules[atom] is None:
            return True
        node = getattr(node, "_modules", {}).get(atom)
        if node is None:
            return False
    return False


def check_plan_matches_model(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Raise ValueError for plan keys that match no submodule (torch would only warn); on a
    pipeline stage, keys of modules other stages hold are not checked here (the whole model's
    check before launch covers them)."""
    fqns = [n for n, _ in model.named_modules() if n]
    missing = [
        k for k in plan if not any(_fqn_matches(k, n) for n in fqns) and not _removed_by_split(model, k)
    ]
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
        embeddings = [f for f, m in names.items() if isinstance(m, nn.Embedding) and _fqn_matches(key, f)]
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
            if not isinstance(module, nn.Embedding) or not _fqn_matches(key, fqn):
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


def _check_no_statistics_over_sharded_mlp(config: Any, sharding: list[str]) -> None:
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
    found = _layers_prefix(model)
    if found is None:
        return
    prefix = found[0]
    sharding = [k for k, style in plan.items() if not isinstance(style, _LAYOUT_ONLY_STYLES)]
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
        return any(_fqn_matches(k, ".".join(atoms[:n])) for k in sharding for n in range(1, len(atoms) + 1))

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


def _layers_prefix(model: nn.Module) -> tuple[str, nn.Module] | None:
    """FQN and first element of the decoder-layer ModuleList (`find_layer_list`: ``model.layers``,
    GPT-2's ``transformer.h``; a pipeline stage may hold layers "2", "3" only)."""
    found = find_layer_list(model)
    return None if found is None else (found[0], next(iter(found[1])))


def default_llama_tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> TPPlan:
    """The Llama-style plan (Llama, Qwen2/3, Mistral and look-alikes), built from the names present.

    Attention q/k/v and MLP gate/up are colwise, o/down rowwise, the embedding rowwise, the LM head
    colwise with gathered logits. With ``sequence_parallel`` the norms and the residual stream are
    sharded along the sequence (dim 1) between the TP regions.
    """
    found = _layers_prefix(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} has no ModuleList of decoder layers; give an explicit tp_plan"
        )
    layers, layer = found
    names = {n for n, _ in layer.named_modules()}
    required = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    if not required <= names:
        raise ValueError(f"{type(layer).__name__} lacks {sorted(required - names)}; give an explicit tp_plan")
    root = {n for n, _ in model.named_modules()}
    base = layers.rpartition(".")[0]
    embed = f"{base}.embed_tokens" if base else "embed_tokens"
    norm = f"{base}.norm" if base else "norm"
    tied = bool({embed, "lm_head"} & tied_weight_modules(model))
    seq = Shard(1)
    plan: TPPlan = {}
    if embed in root and not tied:
        plan[embed] = (
            RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False)
            if sequence_parallel
            else RowwiseParallel(input_layouts=Replicate())
        )
    elif embed in root and sequence_parallel:
        # A tied embedding stays replicated; its output enters the sequence-sharded residual stream.
        plan[embed] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=seq, use_local_output=False
        )
    if sequence_parallel and norm in root:
        plan[norm] = SequenceParallel()
    if "lm_head" in root and not tied:
        plan["lm_head"] = ColwiseParallel(
            input_layouts=seq if sequence_parallel else Replicate(), output_layouts=Replicate()
        )
    elif "lm_head" in root and sequence_parallel:
        # A tied (replicated) head reads the whole sequence.
        plan["lm_head"] = PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    row_out = {"output_layouts": seq, "use_local_output": False} if sequence_parallel else {}
    lp = f"{layers}.*."
    for proj in ("q_proj", "k_proj", "v_proj"):
        plan[f"{lp}self_attn.{proj}"] = ColwiseParallel()
    plan[f"{lp}self_attn.o_proj"] = RowwiseParallel(**row_out)
    head_dim = max(head_dims(model_text_config(model)), default=0)
    for qk_norm in ("q_norm", "k_norm"):
        if f"self_attn.{qk_norm}" in names:
            weight = getattr(layer.get_submodule(f"self_attn.{qk_norm}"), "weight", None)
            if weight is not None and head_dim and weight.numel() > head_dim:
                # A norm over all heads together needs statistics from every tp rank.
                raise ValueError(
                    f"{type(layer).__name__}.self_attn.{qk_norm} normalizes across heads (weight of "
                    f"{weight.numel()} > head_dim {head_dim}); the default plan cannot shard it: give an explicit tp_plan"
                )
            plan[f"{lp}self_attn.{qk_norm}"] = translate_to_torch_parallel_style(
                "replicated_with_grad_allreduce"
            )
    has_mlp = {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"} <= names
    if has_mlp:
        plan[f"{lp}mlp.gate_proj"] = ColwiseParallel()
        plan[f"{lp}mlp.up_proj"] = ColwiseParallel()
        plan[f"{lp}mlp.down_proj"] = RowwiseParallel(**row_out)
    if sequence_parallel:
        if not has_mlp and "mlp.experts" in names:
            raise ValueError(
                f"sequence_parallel is not supported for MoE decoder layers ({type(layer).__name__}); "
                "use tp_size > 1 without sequence_parallel (experts are parallelized by ep_size)"
            )
        if not has_mlp:
            raise ValueError(
                f"{type(layer).__name__} has no dense mlp.gate/up/down_proj; sequence parallel needs an explicit tp_plan"
            )
        # Every norm directly in the layer (input/post-attention, and the pre-/post-feed-forward
        # norms of Gemma 2/3 and others) acts on the sequence-sharded residual stream. Any other
        # module with weights there (Gemma 4's per-layer-input gate and projection) would read
        # those shards with whole weights, which this plan does not lay out.
        unplanned = []
        for child_name, child in layer.named_children():
            params = list(child.parameters())
            if child_name in ("self_attn", "mlp") or not params:
                continue
            if all(p.dim() == 1 for p in params):
                plan[f"{lp}{child_name}"] = SequenceParallel()
            else:
                unplanned.append(child_name)
        if unplanned:
            raise ValueError(
                f"{type(layer).__name__} has modules with weights besides self_attn and mlp ({unplanned}) that "
                "read the residual stream, which sequence parallel shards; sequence parallel needs an explicit tp_plan"
            )
        plan[f"{lp}self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
        plan[f"{lp}mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    return plan


def _explicit_plan(tp_plan: Mapping[str, Any] | str) -> TPPlan:
    if isinstance(tp_plan, str):
        obj = import_class_from_path(tp_plan)
        if callable(obj) and not isinstance(obj, Mapping):
            obj = obj()
        if not isinstance(obj, Mapping):
            raise ValueError(
                f"tp_plan {tp_plan!r} must name a dict or a function returning one, got {type(obj).__name__}"
            )
        tp_plan = obj
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        raise ValueError(f"tp_plan must be a non-empty dict of module name -> style, got {tp_plan!r}")
    plan: TPPlan = {}
    for key, style in tp_plan.items():
        if isinstance(style, str):
            style = translate_to_torch_parallel_style(style)
        if not isinstance(style, ParallelStyle):
            raise ValueError(f"tp_plan[{key!r}] must be a ParallelStyle or a style string, got {style!r}")
        plan[key] = style
    return plan


#: Styles that only re-lay activations and leave a module's parameters alone.
_LAYOUT_ONLY_STYLES = (PrepareModuleInput, PrepareModuleOutput)


def _drop_tied(plan: TPPlan, model: nn.Module, *, explicit: bool) -> TPPlan:
    """Leave the modules holding tied weights out of the plan: TP would shard such a weight once
    per owner (rowwise in the embedding, colwise in the head) and so untie it, each owner training
    its own copy, silently unlike one process."""
    tied = tied_weight_modules(model)
    hits = [
        key
        for key, style in plan.items()
        if not isinstance(style, _LAYOUT_ONLY_STYLES) and any(_fqn_matches(key, name) for name in tied)
    ]
    if hits and explicit:
        raise ValueError(
            f"tp_plan shards {hits}, which hold weights tied to another module ({sorted(tied)}); "
            "sharding them would untie the weights. Leave them out of the plan (they stay replicated "
            "over tp) or build the model with tie_word_embeddings=False"
        )
    for key in hits:
        logger.info("TP plan: leaving %s replicated (its weight is tied to another module)", key)
    return {k: v for k, v in plan.items() if k not in hits}


def _require_declared_tp_support(model: nn.Module) -> None:
    """The automatic plans need a model whose attention is written for sharded heads, which a
    Hugging Face model declares with a tensor-parallel plan (``base_model_tp_plan``); a model
    without one may hard-code the head count and would crash or, worse, compute something else."""
    config = model_text_config(model)
    if getattr(config, "base_model_tp_plan", None):
        return
    raise ValueError(
        f"model_type {getattr(config, 'model_type', type(model).__name__)!r} declares no tensor-parallel plan "
        "(config.base_model_tp_plan), so its attention is not known to work with sharded heads; give an "
        "explicit tp_plan"
    )


def resolve_tp_plan(
    model: nn.Module, *, tp_plan: Mapping[str, Any] | str | None = None, sequence_parallel: bool = False
) -> TPPlan:
    """The TP plan to apply: explicit -> the model's HF plan -> Llama-style default (see module doc).

    Modules holding tied weights stay replicated over tp (an explicit plan that shards them is a
    ValueError): the tie, and so the single-process math, is kept.
    """
    if tp_plan is not None:
        return _drop_tied(_explicit_plan(tp_plan), model, explicit=True)
    _require_declared_tp_support(model)
    if sequence_parallel:
        plan = default_llama_tp_plan(model, sequence_parallel=True)
        _check_sequence_parallel_applies(model)
        return _drop_tied(plan, model, explicit=False)
    try:
        plan = get_hf_tp_shard_plan(model)
    except ValueError:
        plan = {}
    if not plan:
        plan = default_llama_tp_plan(model, sequence_parallel=False)
    return _drop_tied(plan, model, explicit=False)


def _check_sequence_parallel_applies(model: nn.Module) -> None:
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
        for p, v in module._parameters.items()
        if v is not None
    ]
    if own:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"sequence parallel: model_type {model_type!r} holds parameters {own[:3]} in container modules "
            "(outside any module the sequence-parallel plan lays out), which its forward combines with the "
            "sequence-sharded hidden states; use tensor parallelism without sequence_parallel"
        )


def plan_has_sequence_parallel(plan: Mapping[str, ParallelStyle]) -> bool:
    """True when some style shards activations along the sequence (then position ids must be explicit)."""
    return any(type(s) is SequenceParallel and s.sequence_sharding[0] == Shard(1) for s in plan.values())


# ---- LoRA adapters ------------------------------------------------------------------------
# A LoRA-wrapped linear (an ``nn.Linear`` with ``lora_A``/``lora_B`` ``nn.Linear`` children,
# y = x W^T + s * (x A^T) B^T) follows the plan key of the linear: the base weight is sharded as the
# style says, and the adapters so that no extra collective is needed inside the module:
#   colwise (W: Shard(0)): A replicated, B Shard(0)  -> both terms come out Shard(-1)
#   rowwise (W: Shard(1)): A Shard(1), B replicated  -> both terms come out Partial (summed by the
#                                                     style's output all-reduce / reduce-scatter)


def has_lora_adapter(module: nn.Module) -> bool:
    """True for a linear carrying LoRA adapters as ``lora_A``/``lora_B`` ``nn.Linear`` children."""
    return isinstance(getattr(module, "lora_A", None), nn.Linear) and isinstance(
        getattr(module, "lora_B", None), nn.Linear
    )


def _shard_own_params(module: nn.Module, device_mesh: DeviceMesh, placement: Any, src: Any) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = nn.Parameter(
            distribute_tensor(param, device_mesh, [placement], src_data_rank=src),
            requires_grad=param.requires_grad,
        )
        module.register_parameter(name, dist_param)


class _LoRAColwiseMixin:
    """Colwise base weight; ``lora_A`` left replicated, ``lora_B`` sharded on its output rows."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name == "lora_A":
            return  # distribute_module replicates what the partition function leaves alone
        if name == "" and has_lora_adapter(module):
            # torch's colwise function walks every parameter recursively (adapters included)
            _shard_own_params(module, device_mesh, Shard(0), self.src_data_rank)
            return
        super()._partition_linear_fn(name, module, device_mesh)


class _LoRARowwiseMixin:
    """Rowwise base weight; ``lora_A`` sharded on its input columns, ``lora_B`` replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name == "lora_B":
            return
        super()._partition_linear_fn(name, module, device_mesh)  # "": W Shard(1), bias R; lora_A: Shard(1)


@functools.cache
def _lora_style_class(style_cls: type) -> type:
    mixin = _LoRAColwiseMixin if issubclass(style_cls, ColwiseParallel) else _LoRARowwiseMixin
    return type(f"LoRA{style_cls.__name__}", (mixin, style_cls), {})


def with_lora_adapters(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> TPPlan:
    """`plan` with its colwise/rowwise styles extended to lay out LoRA adapters too (see above).

    Unchanged when `model` has no LoRA-wrapped linear. The extended styles shard a plain linear
    exactly as before, so a key matching wrapped and unwrapped linears alike is fine.
    """
    if not any(has_lora_adapter(m) for m in model.modules()):
        return dict(plan)
    out: TPPlan = {}
    for key, style in plan.items():
        if isinstance(style, ColwiseParallel | RowwiseParallel) and not isinstance(
            style, _LoRAColwiseMixin | _LoRARowwiseMixin
        ):
            extended = object.__new__(_lora_style_class(type(style)))
            extended.__dict__.update(copy.copy(style.__dict__))  # same layouts and options
            style = extended
        out[key] = style
    return out


__all__ = [
    "TPPlan",
    "check_plan_matches_model",
    "default_llama_tp_plan",
    "get_hf_tp_shard_plan",
    "has_lora_adapter",
    "plan_has_sequence_parallel",
    "resolve_tp_plan",
    "tied_weight_modules",
    "translate_to_torch_parallel_style",
    "validate_tp_mesh",
    "with_lora_adapters",
]
