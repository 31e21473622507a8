"""Loss and gradient parity of the FSDP2 strategy's stack on MoE models under expert parallelism
(automodel.moe splits the experts, automodel.fsdp2 checkpoints and shards everything), against one
process, on real gloo ranks; with each FSDP2 option (compile, prefetch, offload, autocast) too.

The reference runs the same model on every data shard in turn and accumulates gradients, which
is exactly what data parallelism computes (the auxiliary loss is per micro-batch in both).
"""

from __future__ import annotations

import copy
from typing import cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from automodel.fsdp2 import FSDP2Config
from automodel.mesh import MeshContext, ParallelismSizes
from automodel.mesh.layout_report import default_layers_fqn, describe_module, rank_report
from automodel.mesh.model_parts import canonical_fqn
from automodel.moe import MoEParallelizerConfig
from automodel.recipes.strategies.fsdp2 import apply_fsdp2_stack
from automodel.testing.layout_check import check_layout_applied
from automodel.testing.layout_table import LAYOUTS
from automodel.testing.moe import build_tiny_model, preload
from automodel.testing.ranks import run_on_ranks

preload()

SEQ, PER_RANK, VOCAB, TOL = 16, 2, 256, 1e-5


def _batch(step: int, num_seqs: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (num_seqs, SEQ), generator=g)


def _shard_loss(model, ids, *, num_shards: int, pure_sum: bool, autocast: bool = False) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, output_router_logits=True)
    ce = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1), reduction="sum"
    )
    aux = model.config.router_aux_loss_coef * out.aux_loss
    tokens = ids[:, 1:].numel()
    if pure_sum:  # recipes' convention: CE sum over global label tokens; aux averaged over shards
        return ce / (tokens * num_shards) + aux / num_shards
    return ce / tokens + aux  # per-rank mean; FSDP averages over the shards


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _parity_rank(
    family: str,
    sizes: ParallelismSizes,
    *,
    model_kwargs: dict,
    config: dict,
    ac: bool = False,
    pure_sum: bool = True,
    steps: int = 2,
    options: dict | None = None,
) -> dict:
    ctx = MeshContext.build(sizes)
    dp, coords = ctx.layout.dp, ctx.coordinates
    dp_index = coords["dp_replicate"] * ctx.layout.dp_shard + coords["dp_shard"]
    model = build_tiny_model(family, **model_kwargs)
    ref = copy.deepcopy(model)
    options = options or {}
    autocast = options.get("autocast_dtype") is not None
    apply_fsdp2_stack(
        model,
        mesh=ctx,
        config=FSDP2Config(
            **{"mp_policy": MixedPrecisionPolicy(), "activation_checkpointing": ac, **options}
        ),
        moe_config=MoEParallelizerConfig(**config),
        gradient_divide_factor=1.0 if pure_sum else None,
    )
    # what this rank holds (automodel.mesh.layout_report), for the applied-layout check
    report = rank_report(
        parts=[describe_module(model, layers_fqn=default_layers_fqn(model))], mesh=ctx, strategy="fsdp2"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_params = dict(ref.named_parameters())
    result = {
        "loss": [],
        "ref_loss": [],
        "grad_rel": [],
        "names": sorted(canonical_fqn(n) for n, _ in model.named_parameters()),
        "report": report,
        "layout": _layout_facts(model),
    }
    for step in range(steps):
        ids = _batch(step, dp * PER_RANK)
        # under autocast both sides compute in bf16 (the one-process side by the context here)
        loss = _shard_loss(model, ids.chunk(dp)[dp_index], num_shards=dp, pure_sum=pure_sum)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        result["loss"].append(total.item() if pure_sum else total.item() / dp)
        ref_total = 0.0
        for shard in ids.chunk(dp):
            ref_loss = _shard_loss(ref, shard, num_shards=dp, pure_sum=pure_sum, autocast=autocast)
            (ref_loss if pure_sum else ref_loss / dp).backward()
            ref_total += ref_loss.item() if pure_sum else ref_loss.item() / dp
        result["ref_loss"].append(ref_total)
        worst = 0.0
        for name, p in model.named_parameters():
            worst = max(worst, _rel(_full(p.grad).to(p.device), ref_params[canonical_fqn(name)].grad))
        result["grad_rel"].append(worst)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    result["weight_rel"] = max(
        _rel(_full(p.detach()), ref_params[canonical_fqn(n)].detach()) for n, p in model.named_parameters()
    )
    result["expert_local_shape"] = [
        tuple(cast(DTensor, p).to_local().shape)
        for n, p in model.named_parameters()
        if n.endswith("experts.gate_up_proj")
    ]
    return result


def _layout_facts(model: torch.nn.Module) -> dict:
    """What the applier did: the FSDP2 units (FQN -> mesh dims) and each parameter's placement."""
    units: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if isinstance(module, FSDPModule) and own:
            assert isinstance(own[0], DTensor), name
            units[name] = list(own[0].device_mesh.mesh_dim_names or ())
    params = {
        name: (list(p.device_mesh.mesh_dim_names or ()), [str(pl) for pl in p.placements], str(p.device))
        for name, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    states = {name: m._get_fsdp_state() for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    groups = {name: state._fsdp_param_group for name, state in states.items() if state._fsdp_param_group}
    layers = cast(torch.nn.ModuleList, model.get_submodule("model.layers"))
    return {
        "units": units,
        "params": params,
        "offload": sorted({type(g.offload_policy).__name__ for g in groups.values()}),
        "forward_prefetch": [
            len(states[f"model.layers.{i}"]._states_to_forward_prefetch) for i in range(len(layers))
        ],
        "compiled": [getattr(layer, "_compiled_call_impl", None) is not None for layer in layers],
        "autocast": hasattr(model.forward, "__wrapped__"),
    }


def _check(results: list[dict], *, tol: float = TOL) -> None:
    for r in results:
        for got, want in zip(r["loss"], r["ref_loss"], strict=True):
            assert abs(got - want) <= tol * abs(want), (r["loss"], r["ref_loss"])
        assert max(r["grad_rel"]) < tol, r["grad_rel"]
        assert r["weight_rel"] < tol, r["weight_rel"]
        assert r["names"] == results[0]["names"]


#: The shared layouts (`automodel.testing.layout_table`) of the MoE model split over ep and data
#: parallelism only (pipeline, TP and CP meet EP in the parity matrix).
EP_LAYOUTS = {
    layout.name: layout
    for layout in LAYOUTS
    if layout.model == "moe" and layout.axes <= {"ep", "dp_replicate"}
}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("layout", list(EP_LAYOUTS))
def test_parity_pure_sum(family: str, layout: str) -> None:
    shared = EP_LAYOUTS[layout]
    results = run_on_ranks(
        _parity_rank,
        world_size=shared.ranks,
        args=(family, shared.sizes()),
        kwargs={"model_kwargs": {}, "config": {}},
        timeout_s=300,
    )
    _check(results)
    # Each rank holds E/ep experts of the 8, whatever FSDP did on top.
    ep = shared.size("ep_size")
    assert all(shape[0] <= 8 // ep for r in results for shape in r["expert_local_shape"])
    # and holds what the layout says: experts split over ep (and ep_shard), the rest FSDP-sharded
    check_layout_applied(
        [r["report"] for r in results],
        layout=shared,
        layers=2,
        num_experts=8,
    )


def test_parity_averaging_qwen2_moe_shared_expert() -> None:
    """torch's default averaging (gradient_divide_factor=None); Qwen2-MoE adds a shared expert."""
    results = run_on_ranks(
        _parity_rank,
        world_size=4,
        args=("qwen2_moe", ParallelismSizes(ep_size=2)),
        kwargs={"model_kwargs": {}, "config": {}, "pure_sum": False},
        timeout_s=300,
    )
    _check(results)


def test_parity_more_shards_than_local_experts_shards_dim1() -> None:
    """4 experts over ep=2 -> 2 local experts on ep_shard=4 ranks of 8 (HSDP 2x4): FSDP shards dim 1."""
    results = run_on_ranks(
        _parity_rank,
        world_size=8,
        args=("mixtral", ParallelismSizes(ep_size=2, dp_replicate_size=2)),
        kwargs={"model_kwargs": {"num_experts": 4}, "config": {}, "steps": 1},
        timeout_s=400,
    )
    _check(results)
    # Shard(1) over ep_shard: every rank keeps both local experts, a slice of their rows.
    assert all(shape[0] == 2 and shape[1] < 64 for r in results for shape in r["expert_local_shape"])


@pytest.mark.parametrize("ignore_router_for_ac", [True, False])
def test_parity_activation_checkpointing(ignore_router_for_ac: bool) -> None:
    config = {"ignore_router_for_ac": ignore_router_for_ac, "reshard_after_forward": True}
    results = run_on_ranks(
        _parity_rank,
        world_size=4,
        args=("qwen3_moe", ParallelismSizes(ep_size=2)),
        kwargs={"model_kwargs": {}, "config": config, "ac": True},
        timeout_s=300,
    )
    _check(results)


def test_parity_no_outer_wrap_fp32_head() -> None:
    config = {"wrap_outer_model": False, "lm_head_precision": "float32"}
    results = run_on_ranks(
        _parity_rank,
        world_size=2,
        args=("mixtral", ParallelismSizes(ep_size=2)),
        kwargs={"model_kwargs": {}, "config": config},
        timeout_s=300,
    )
    _check(results)


#: Each FSDP2 option under ep=2 on 4 ranks (experts FSDP-sharded over ep_shard=2), fp32 unless autocast.
#: Plain compile is `heavy` (80-150 s of inductor on 2 cores); compile with AC stays in the CPU suite.
OPTIONS = {
    "compile": {"enable_compile": True},
    # compiled checkpointed layers replaying the routers' top-k in the recomputation
    "compile_ac": {"enable_compile": True, "activation_checkpointing": True},
    "prefetch": {"enable_fsdp2_prefetch": True},
    "offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
    "autocast": {"autocast_dtype": torch.bfloat16},
}


@pytest.mark.parametrize(
    "option", [pytest.param(name, marks=[pytest.mark.heavy] if name == "compile" else []) for name in OPTIONS]
)
def test_parity_fsdp2_options_with_ep(option: str) -> None:
    """The dense models' options hold with EP too: same numbers as one process, and applied."""
    results = run_on_ranks(
        _parity_rank,
        world_size=4,
        args=("qwen3_moe", ParallelismSizes(ep_size=2)),
        kwargs={"model_kwargs": {}, "config": {}, "options": OPTIONS[option]},
        timeout_s=600,
    )
    # bf16 compute under autocast on both sides, but the expert sums are grouped differently
    _check(results, tol=3e-2 if option == "autocast" else TOL)
    for r in results:
        facts = r["layout"]
        experts = {n: v for n, v in facts["params"].items() if ".experts." in n}
        dense = {n: v for n, v in facts["params"].items() if ".experts." not in n}
        # experts: EP Shard(0) over ep, FSDP over ep_shard; everything else over dp_shard_cp
        assert experts and all(v[0] == ["ep_shard", "ep"] and v[1][1] == "S(0)" for v in experts.values()), (
            experts
        )
        assert dense and all(v[0] == ["dp_shard_cp"] for v in dense.values()), dense
        assert all(v[1] == ["S(0)"] for v in dense.values()), dense
        assert r["expert_local_shape"] == [(2, 64, 64)] * 2  # 8 experts / ep 2 / ep_shard 2
        expert_units = [u for u in facts["units"] if u.endswith(".mlp.experts")]
        assert len(expert_units) == 2 and all(
            set(facts["units"][u]) == {"ep_shard", "ep"} for u in expert_units
        )
        if option == "offload":
            assert facts["offload"] == ["CPUOffloadPolicy"], facts["offload"]
        if option == "prefetch":
            # layer 0 prefetches layer 1 and the experts unit nested in it
            assert facts["forward_prefetch"] == [2, 0], facts["forward_prefetch"]
        if option.startswith("compile"):
            assert facts["compiled"] == [True, True]
        if option == "autocast":
            assert facts["autocast"]
