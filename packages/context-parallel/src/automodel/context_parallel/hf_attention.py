"""CP attention as a transformers attention implementation, and the appliers for a model.

`apply_context_parallel` tags every attention module (``*self_attn``, or any module calling
transformers' attention functions) with its CP group and backend and
switches the model to the registered ``"context_parallel"`` attention implementation, so an
unchanged HF model calls `context_parallel_attention` on its local Q/K/V. Per-step data that
attention needs arrives as model kwargs (``cu_seqlens_padded`` etc. from
`make_cp_batch_and_ctx`), which transformers forwards to the attention function.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from automodel.context_parallel.backends import (
    check_kv_rotation,
    cp_submesh,
    import_transformer_engine,
    resolve_backend,
)
from automodel.context_parallel.layout import load_balanced_indices
from automodel.context_parallel.ring_attention import ring_attention
from automodel.context_parallel.thd import document_ids, thd_partitioned_indices
from automodel.context_parallel.torch_internals import unwrap_checkpointed
from automodel.mesh.model_parts import canonical_fqn, in_other_submodel, other_submodel_prefixes

ATTN_IMPLEMENTATION = "context_parallel"
_SPEC_ATTR = "_automodel_cp_spec"
_HOOK_ATTR = "_automodel_cp_hooked"


@dataclass(eq=False)
class CPAttentionSpec:
    """What one attention module needs under CP (attached to the module by the applier)."""

    group: ProcessGroup
    backend: str
    kv_rotation: str
    cp_size: int
    cp_rank: int
    te_modules: dict[tuple, Any] = field(default_factory=dict, repr=False)
    calls: int = 0  # context_parallel_attention calls through this module (see `_require_ring_call`)


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _torch_sdpa(query, key, value, *, causal: bool, scale: float | None) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    # Looked up at call time: torch's context_parallel() patches this function during the step.
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return sdpa(query, _repeat_kv(key, groups), _repeat_kv(value, groups), is_causal=causal, scale=scale)


def _te_attention(spec: CPAttentionSpec, query, key, value, *, scale: float, kwargs: dict) -> torch.Tensor:
    te = import_transformer_engine()
    b, hq, s, d = query.shape
    hkv = key.shape[1]
    cu_p = kwargs.get("cu_seqlens_padded")
    fmt = "bshd" if cu_p is None else "thd"
    cache_key = (hq, hkv, d, fmt, float(scale))
    attn = spec.te_modules.get(cache_key)
    if attn is None:
        attn = te.DotProductAttention(
            num_attention_heads=hq,
            kv_channels=d,
            num_gqa_groups=hkv,
            attention_dropout=0.0,
            qkv_format=fmt,
            attn_mask_type="causal" if fmt == "bshd" else "padding_causal",
            softmax_scale=scale,
        )
        ranks = dist.get_process_group_ranks(spec.group)
        attn.set_context_parallel_group(spec.group, ranks, torch.cuda.Stream(), "p2p")
        spec.te_modules[cache_key] = attn
    if fmt == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        out = attn(q, k, v)
        return out.view(b, s, hq, d).transpose(1, 2)
    if b != 1:
        raise ValueError(f"packed (THD) attention needs batch size 1, got {b}")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    cu = kwargs.get("cu_seqlens", cu_p).to(torch.int32)
    cu_p = cu_p.to(torch.int32)
    max_len = int(kwargs.get("max_seqlen") or int((cu_p[1:] - cu_p[:-1]).max()))
    out = attn(
        q,
        k,
        v,
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_p,
        cu_seqlens_kv_padded=cu_p,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )
    return out.view(s, hq, d).transpose(0, 1).unsqueeze(0)


@torch.compiler.disable  # collectives inside an autograd.Function: keep it out of compiled graphs
def context_parallel_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: Q ``[B, Hq, S_local, D]``, K/V ``[B, Hkv, S_local, D]``."""
    spec: CPAttentionSpec | None = getattr(module, _SPEC_ATTR, None)
    if spec is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation={ATTN_IMPLEMENTATION!r} but "
            "apply_context_parallel() was not applied to the model"
        )
    spec.calls += 1
    if dropout:
        raise ValueError(
            f"attention dropout is not supported under context parallelism, got dropout={dropout}"
        )
    window = kwargs.get("sliding_window")
    if (
        window is not None and window < query.shape[2] * spec.cp_size
    ):  # a window >= the sequence is full attention
        raise ValueError(
            f"sliding_window={window}: sliding-window attention is not supported under "
            "context parallelism; use cp_size=1 for this model or disable its sliding window"
        )
    for option in _UNSUPPORTED_ATTENTION_KWARGS:
        if kwargs.get(option) is not None:
            raise ValueError(
                f"attention with {option} (attention sinks or logit soft-capping) is not supported under "
                "context parallelism; use cp_size=1 for this model"
            )
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    cu_p = kwargs.get("cu_seqlens_padded")
    if spec.backend == "te":
        out = _te_attention(spec, query, key, value, scale=scale, kwargs=kwargs)
    elif cu_p is None and spec.backend == "torch":
        out = _torch_sdpa(query, key, value, causal=causal, scale=scale)
    else:
        s_local = query.shape[2]
        total = s_local * spec.cp_size
        doc = None
        if cu_p is None:
            index = load_balanced_indices(
                total, cp_size=spec.cp_size, cp_rank=spec.cp_rank, device=query.device
            )
        else:
            cu_p = cu_p.to(query.device)
            index = thd_partitioned_indices(cu_p, total, spec.cp_size, spec.cp_rank)
            doc = document_ids(cu_p, index)
        out = ring_attention(
            query,
            key,
            value,
            cp_group=spec.group,
            token_index=index,
            doc_ids=doc,
            causal=causal,
            scale=scale,
            kv_rotation=spec.kv_rotation,
        )
    return out.transpose(1, 2).contiguous(), None


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention modules: those named ``*self_attn`` and, whatever their name
    (GPT-2's ``attn``, GPT-NeoX's ``attention``, Falcon's ``self_attention``), those whose forward
    calls transformers' attention functions; the outermost of nested ones."""
    found: list[torch.nn.Module] = []
    prefixes: list[str] = []
    for name, module in model.named_modules():
        inner = unwrap_checkpointed(module)
        if any(name.startswith(p) for p in prefixes) or inner in found:
            continue
        if name.endswith("self_attn") or _dispatches_attention(type(inner)):
            # Hook the wrapped module so activation-checkpoint recomputation sees the same state.
            found.append(inner)
            prefixes.append(f"{name}.")
    return found


def context_parallel_modules(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s modules that run attention context-parallel: tagged with a CP group
    by `apply_context_parallel` and carrying its hooks (read off the live model, for the layout
    report: a layout whose CP was switched off lists none)."""
    return [
        canonical_fqn(name)
        for name, module in model.named_modules()
        if getattr(module, _SPEC_ATTR, None) is not None and getattr(module, _HOOK_ATTR, False)
    ]


def _forward_source(cls: type) -> str | None:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def _dispatches_attention(cls: type) -> bool:
    """Whether `cls.forward` reaches transformers' attention functions (the CP attention's entry)."""
    if cls.forward is torch.nn.Module.forward or cls.__module__.startswith("torch."):
        return False
    source = _forward_source(cls)
    return source is not None and any(marker in source for marker in _DISPATCH_MARKERS)


#: Names through which a transformers attention module calls the configured attention function.
_DISPATCH_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface")


#: Attention-function arguments that change the math and the ring attention does not implement.
_UNSUPPORTED_ATTENTION_KWARGS = ("s_aux", "sinks", "softcap")


def _computes_attention_itself(cls: type) -> bool:
    """True when `cls.forward` never calls transformers' attention functions (its own matmuls),
    so the registered CP attention would not run. Unknown source counts as dispatching; the
    runtime guard (`_require_ring_call`) still catches it."""
    source = _forward_source(cls)
    return source is not None and not any(marker in source for marker in _DISPATCH_MARKERS)


def check_context_parallel_support(model: torch.nn.Module, *, seq_length: int) -> None:
    """ValueError (naming the model_type and why) for a model the CP attention cannot run exactly:
    no attention modules to hook, attention computed by the module itself instead of through
    transformers' attention functions, layers mixing the sequence otherwise (convolution, linear
    attention), a sliding window shorter than `seq_length` (the ring has no window mask), attention
    sinks, attention logit soft-capping, or positions derived from the input length."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    modules = _attention_modules(model)
    hooked = {id(m) for m in modules}
    # Text-decoder modules named like attention that hold no hooked module and never dispatch compute attention
    # in their own code (the usual case of an older architecture; GIT's text decoder beside its
    # dispatching vision tower): the ring would not run there, each rank attending to its chunk.
    towers = other_submodel_prefixes(model)  # a vision tower does not run in text training
    own = sorted(
        {
            type(m).__name__
            for name, m in model.named_modules()
            if type(m).__name__.endswith("Attention")
            and not in_other_submodel(name, towers)
            and not any(id(x) in hooked for x in m.modules())
            and _computes_attention_itself(type(m))
        }
        | {type(m).__name__ for m in modules if _computes_attention_itself(type(m))}
    )
    if not modules and not own:
        raise ValueError(
            f"model_type {model_type!r} has no attention modules to make context-parallel (none named "
            "'*self_attn', none calling transformers' attention functions)"
        )
    if own:
        # The ring attention is reached only through transformers' attention interface; a module
        # doing its own matmuls would attend within each rank's chunk of the sequence only.
        raise ValueError(
            f"model_type {model_type!r} computes attention inside {', '.join(own)} (it does not call "
            "transformers' attention functions), so context parallelism cannot run its attention over "
            "the whole sequence"
        )

    names = {id(m): n for n, m in model.named_modules()}
    mask_decides = sorted(
        {
            type(m).__name__
            for m in modules
            if not in_other_submodel(names.get(id(m), ""), towers)
            and getattr(m, "is_causal", True) is False
            and "is_causal" not in inspect.signature(type(m).forward).parameters
        }
    )
    if mask_decides:
        # The ring replaces the dense mask by causal attention; a module flagged non-causal that
        # does not take the flag as an argument passes its own False to the attention function and
        # gets its causality (or lack of it) from that mask alone (GIT's text decoder; measured:
        # 8.5e-4 off one process), so it would attend bidirectionally over the ring.
        raise ValueError(
            f"model_type {model_type!r}: {', '.join(mask_decides)} declares is_causal=False and takes what it "
            "attends to from its attention mask, which context parallelism replaces by causal ring attention"
        )
    if "position_ids" not in inspect.signature(type(model).forward).parameters:
        # Each rank holds a chunk of the sequence: positions must come from the batch, not the length.
        raise ValueError(
            f"model_type {model_type!r} takes no position_ids (it derives positions from the input length), "
            "so a rank's sequence chunk would get the wrong positions under context parallelism"
        )
    window = getattr(config, "sliding_window", None)
    layer_types = [str(t) for t in getattr(config, "layer_types", None) or []]
    mixers = sorted({t for t in layer_types if not t.endswith("_attention") or t == "linear_attention"})
    if mixers:
        # Only softmax attention is made context-parallel; a convolution or a linear-attention
        # (recurrent) layer would see just this rank's chunk of the sequence.
        raise ValueError(
            f"model_type {model_type!r} has {', '.join(mixers)} layers, which context parallelism does not "
            "split the sequence for (only softmax attention layers are context-parallel)"
        )
    windowed = (
        any("sliding" in t or "chunked" in t for t in layer_types)
        if layer_types
        else getattr(config, "use_sliding_window", True) is not False
    )
    if windowed and isinstance(window, int) and window < seq_length:
        raise ValueError(
            f"model_type {model_type!r} has sliding-window attention (sliding_window={window} < sequence "
            f"length {seq_length}), which context parallelism does not support"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"model_type {model_type!r} soft-caps attention logits (attn_logit_softcapping="
            f"{config.attn_logit_softcapping}), which context parallelism does not support"
        )
    if any(name.rpartition(".")[2] == "sinks" for m in modules for name, _ in m.named_parameters()):
        raise ValueError(
            f"model_type {model_type!r} has attention sinks, which context parallelism does not support"
        )


def attach_context_parallel_hooks(model: torch.nn.Module) -> None:
    """Make every attention module causal and drop its dense mask (it has the local shape, not the
    global); `is_causal` goes only to forwards that take it (by name or ``**kwargs``)."""

    def _pre_hook(module, args, kwargs):
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None
        if _takes_keyword(type(module).forward, "is_causal"):
            kwargs["is_causal"] = True
        spec = getattr(module, _SPEC_ATTR, None)
        if spec is not None:
            module._automodel_cp_calls_before = spec.calls
        return args, kwargs

    for module in _attention_modules(model):
        if not getattr(module, _HOOK_ATTR, False):
            module.register_forward_pre_hook(_pre_hook, with_kwargs=True, prepend=True)
            module.register_forward_hook(_require_ring_call)
            setattr(module, _HOOK_ATTR, True)


def _takes_keyword(function: Any, name: str) -> bool:
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _require_ring_call(module: torch.nn.Module, _args: tuple, output: Any) -> Any:
    """RuntimeError when an attention module ran without calling the CP attention (it would have
    attended within this rank's chunk only): a loud failure, never a silently different result."""
    spec = getattr(module, _SPEC_ATTR, None)
    before = getattr(module, "_automodel_cp_calls_before", None)
    if spec is not None and before is not None and spec.calls == before:
        raise RuntimeError(
            f"{type(module).__name__} computed attention without transformers' attention functions, so "
            "context parallelism could not run it over the whole sequence"
        )
    return output


def _register_with_transformers() -> None:
    # lazy: optional dependency of this package (transformers)
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, context_parallel_attention)


def _set_attn_implementation(model: torch.nn.Module) -> None:
    configs: list[Any] = [  # HF configs (nn.Module types attribute access as Tensor | Module)
        m.config
        for m in model.modules()
        if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")
    ]
    for config in configs:
        config._attn_implementation = ATTN_IMPLEMENTATION
        for sub in getattr(config, "sub_configs", {}) or {}:
            sub_config = getattr(config, sub, None)
            if sub_config is not None and hasattr(sub_config, "_attn_implementation"):
                sub_config._attn_implementation = ATTN_IMPLEMENTATION


def apply_context_parallel(
    model: torch.nn.Module,
    *,
    cp_mesh: DeviceMesh | None,
    backend: str = "auto",
    kv_rotation: str = "allgather",
) -> str:
    """Make `model`'s attention context-parallel over `cp_mesh`; return the resolved backend.

    Runs after TP and before FSDP (the composition order of docs/architecture.md). With no CP (`cp_mesh` None or of size 1) it
    changes nothing and returns ``"none"``. Pass the returned backend to
    `make_cp_batch_and_ctx` each step.
    """
    check_kv_rotation(kv_rotation)
    cp_mesh = cp_submesh(cp_mesh)
    resolved = resolve_backend(backend, device_type="cpu" if cp_mesh is None else cp_mesh.device_type)
    if cp_mesh is None or cp_mesh.size() == 1:
        return "none"
    if resolved == "te":
        import_transformer_engine()
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no attention modules to make context-parallel (none named "
            "'*self_attn', none calling transformers' attention functions)"
        )
    for module in modules:
        spec = CPAttentionSpec(
            group=cp_mesh.get_group(),
            backend=resolved,
            kv_rotation=kv_rotation,
            cp_size=cp_mesh.size(),
            cp_rank=cp_mesh.get_local_rank(),
        )
        setattr(module, _SPEC_ATTR, spec)
    _register_with_transformers()
    _set_attn_implementation(model)
    attach_context_parallel_hooks(model)
    return resolved
