"""The Llama-style default TP (and SP) plan, built from the module names the model actually has."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from automodel.fsdp2.tp_fqn import decoder_layers_prefix
from automodel.fsdp2.tp_styles import TPPlan, translate_to_torch_parallel_style
from automodel.mesh.model_parts import (
    head_dims,
    model_text_config,
    tied_weight_modules,
)


def default_llama_tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> TPPlan:
    """The Llama-style plan (Llama, Qwen2/3, Mistral and look-alikes), built from the names present.

    Attention q/k/v and MLP gate/up are colwise, o/down rowwise, the embedding rowwise, the LM head
    colwise with gathered logits. With ``sequence_parallel`` the norms and the residual stream are
    sharded along the sequence (dim 1) between the TP regions.
    """
    found = decoder_layers_prefix(model)
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
