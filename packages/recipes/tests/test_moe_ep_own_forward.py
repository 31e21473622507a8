"""Expert parallelism of experts layouts beyond plain SwiGLU: the module's own forward on the owner rank.

Parity (2 gloo ranks, ep2, fp32) against one process on the same data for GPT-OSS (transposed,
interleaved gate/up with biases, clamped gate), Nemotron-H (no gate, relu2), Llama 4 (one block
per expert, router scores scaling the input), JetMoE (rows sorted by expert, in the MLP and the
attention experts), Doge (experts as embedding rows) and DBRX (flat [E*F, H] rows in a child of
the experts module); the probe's refusals; and the one support rule on meta-device models. The
model is parallelized by the FSDP2 strategy's stack (automodel.moe splits the experts,
automodel.fsdp2 checkpoints and shards), as the recipes do.
"""

from __future__ import annotations

import copy
from typing import cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from automodel.fsdp2 import FSDP2Config
from automodel.mesh import MeshContext, ParallelismSizes
from automodel.mesh.model_parts import canonical_fqn
from automodel.moe import ExpertsLayout, MoEParallelizerConfig, apply_ep, check_expert_parallel_support
from automodel.recipes.strategies.fsdp2 import apply_fsdp2_stack
from automodel.testing.ranks import run_on_ranks
from automodel.testing.tiny_model import tiny_causal_lm

SEQ, PER_RANK, VOCAB, TOL = 16, 2, 256, 1e-5
#: Each family's experts under its own names, on the shared tiny sizes (`automodel.testing.tiny_model`).
FAMILIES: dict[str, dict] = {
    "gpt_oss": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "nemotron_h": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        layers_block_type=["moe", "full_attention"],
    ),
    "llama4_text": dict(
        intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1
    ),
    "jetmoe": dict(intermediate_size=32, kv_channels=16, num_local_experts=4, num_experts_per_tok=2),
    "mixtral": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "doge": dict(is_moe=True, intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "dbrx": dict(
        d_model=64,  # its own name, which sets ffn_config.hidden_size (hidden_size comes too late)
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},  # None: its clamp fails
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    ),
}
#: rows per expert on dim 0 of the split parameters (DBRX's flat rows: ffn_hidden_size)
ROWS_PER_EXPERT = {"dbrx": 32}
#: tighter bounds where the layout is new (measured: DBRX loss 4e-8, expert gradients 5e-7)
PARITY_TOL = {"dbrx": 1e-6}


def _build(family: str, *, seed: int = 0, meta: bool = False, **overrides: object) -> nn.Module:
    # eager attention: GPT-OSS has no SDPA path
    fields = {"max_position_embeddings": 128, **FAMILIES.get(family, {}), **overrides}
    return tiny_causal_lm(family, seed=seed, meta=meta, attn="eager", **fields)


def _preload() -> None:
    import importlib

    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    for module in ("gpt_oss", "nemotron_h", "llama4", "jetmoe", "mixtral", "doge", "dbrx", "llama"):
        importlib.import_module(f"transformers.models.{module}.modeling_{module}")


_preload()


def _loss(model: nn.Module, ids: torch.Tensor, *, global_tokens: int) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits  # a KV cache would grow in recomputation
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1), reduction="sum")
    return ce / global_tokens


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters under the bare model's names (no checkpoint-wrapper atoms)."""
    return [(canonical_fqn(n), p) for n, p in model.named_parameters()]


def _ep_parity_rank(family: str, steps: int = 2, ac: bool = False) -> dict:
    ctx = MeshContext.build(ParallelismSizes(ep_size=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build(family)
    ref = copy.deepcopy(model)
    apply_fsdp2_stack(
        model,
        mesh=ctx,
        config=FSDP2Config(mp_policy=MixedPrecisionPolicy(), activation_checkpointing=ac),
        moe_config=MoEParallelizerConfig(),
        gradient_divide_factor=1.0,
    )
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_params = dict(ref.named_parameters())
    out: dict = {"loss_rel": [], "grad_rel": [], "expert_grad_rel": []}
    split = {
        n
        for n, p in _named_parameters(model)
        if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
    }
    out["own_block"] = _holds_own_block(model, ref_params, split, ep_rank=ctx.get_mesh("ep").get_local_rank())
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=torch.Generator().manual_seed(step))
        tokens = ids[:, 1:].numel()
        loss = _loss(model, ids.chunk(world)[rank], global_tokens=tokens)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        ref_total = 0.0
        for shard in ids.chunk(world):  # data parallelism = gradients accumulated over the shards
            ref_loss = _loss(ref, shard, global_tokens=tokens)
            ref_loss.backward()
            ref_total += ref_loss.item()
        out["loss_rel"].append(abs(total.item() - ref_total) / abs(ref_total))
        grads = [(n, _full(p.grad), ref_params[n].grad) for n, p in _named_parameters(model)]
        missing = [n for n, got, want in grads if (got is None) != (want is None)]
        assert not missing, f"gradients present on one side only: {missing}"
        grads = [(n, got, want) for n, got, want in grads if want is not None]
        # Every gradient entry against the largest gradient of the model (a tiny gradient made of
        # cancelling terms, like Doge's attention A, is rounding noise relative to itself), and every
        # expert parameter's gradient against its own largest entry.
        scale = max(want.abs().max() for _, _, want in grads)
        out["grad_rel"].append(max(((got - want).abs().max() / scale).item() for _, got, want in grads))
        out["expert_grad_rel"].append(max(_rel(got, want) for n, got, want in grads if n in split))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # every parameter split over ep: (local experts, all experts)
    out["expert_rows"] = {
        n: (p.to_local().shape[0], p.shape[0])
        for n, p in _named_parameters(model)
        if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
    }
    out["fast_path"] = sorted(
        {m._ep_fast_path for m in model.modules() if getattr(m, "_ep_fast_path", None) is not None}
    )
    return out


def _holds_own_block(
    model: nn.Module, ref_params: dict[str, torch.Tensor], split: set[str], *, ep_rank: int
) -> dict[str, bool | None]:
    """Whether each split parameter's local rows are its ep rank's contiguous block of the one-process
    rows (rank r: experts r*L..(r+1)*L-1); None where FSDP splits them further (ep_shard > 1)."""
    found: dict[str, bool | None] = {}
    for name, param in _named_parameters(model):
        if name in split:
            assert isinstance(param, DTensor), name
            local, full = param.to_local(), ref_params[name]
            rows = local.shape[0]
            whole = (
                rows * param.device_mesh["ep"].size() == full.shape[0] and local.shape[1:] == full.shape[1:]
            )
            found[name] = torch.equal(local, full[ep_rank * rows : (ep_rank + 1) * rows]) if whole else None
    return found


#: (family, experts parameters expected split over ep, the grouped-GEMM fast path's use: [] none ran)
PARITY_CASES = [
    ("gpt_oss", 2 * 4, [False]),  # 2 layers x gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias
    ("nemotron_h", 1 * 2, [False]),  # 1 MoE layer x up_proj, down_proj
    ("llama4_text", 2 * 2, [False]),
    ("jetmoe", 2 * 4, [False]),  # 2 layers x (MLP + attention experts) x input_linear, output_linear
    ("doge", 2 * 2, []),  # 2 layers x down_embed, up_embed: rows fetched from their owner
    ("mixtral", 2 * 2, [True]),
    ("dbrx", 2 * 3, [False]),  # 2 layers x mlp.w1, mlp.v1, mlp.w2 [E*F, H]: F rows per expert
]


@pytest.mark.parametrize(("family", "num_split", "fast_path"), PARITY_CASES, ids=[c[0] for c in PARITY_CASES])
def test_ep2_matches_one_process(family: str, num_split: int, fast_path: list[bool]) -> None:
    results = run_on_ranks(_ep_parity_rank, world_size=2, args=(family,), timeout_s=300)
    tol = PARITY_TOL.get(family, TOL)
    for r in results:
        assert max(r["loss_rel"]) <= tol, r["loss_rel"]
        assert max(r["grad_rel"]) <= tol and max(r["expert_grad_rel"]) <= tol, r
        assert len(r["expert_rows"]) == num_split, r["expert_rows"]
        per_expert = ROWS_PER_EXPERT.get(family, 1)
        assert all(local * 2 == full == 4 * per_expert for local, full in r["expert_rows"].values()), r
        assert set(r["own_block"]) == set(r["expert_rows"]) and all(r["own_block"].values()), r["own_block"]
        assert r["fast_path"] == fast_path


@pytest.mark.parametrize(
    ("family", "world", "ac"),
    [
        ("gpt_oss", 4, False),
        ("llama4_text", 2, True),
        ("jetmoe", 2, True),
        ("doge", 4, True),
        ("dbrx", 4, True),
    ],
)
def test_ep2_composes_with_fsdp_over_ep_shard_and_checkpointing(family: str, world: int, ac: bool) -> None:
    """4 ranks: FSDP2 shards the local experts over ep_shard=2; ac: blocks recomputed, routing replayed."""
    results = run_on_ranks(
        _ep_parity_rank, world_size=world, args=(family,), kwargs={"ac": ac}, timeout_s=300
    )
    for r in results:
        assert max(r["loss_rel"]) <= TOL and max(r["grad_rel"]) <= TOL and max(r["expert_grad_rel"]) <= TOL, r
        assert all(local * world == full for local, full in r["expert_rows"].values()), r["expert_rows"]


# ---- the probe: the own forward must be splittable ------------------------------------------
class _WeightBeforeActivation(nn.Module):
    """Experts whose routing weight enters before the non-linearity: not linear in the weight."""

    def __init__(self, num_experts: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up = nn.Parameter(torch.randn(num_experts, hidden, hidden))

    def forward(self, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
        y = torch.einsum("tkoi,ti->tko", self.up[top_k_index], hidden_states)
        return F.silu(y * top_k_weights.unsqueeze(-1)).sum(1)


class _LinearInWeight(_WeightBeforeActivation):
    """Correct index-routed experts: silu(up_e x), scaled by the routing weight afterwards."""

    def forward(self, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
        y = torch.einsum("tkoi,ti->tko", self.up[top_k_index], hidden_states)
        return (F.silu(y) * top_k_weights.unsqueeze(-1)).sum(1)


class _MixesRows(_WeightBeforeActivation):
    """Linear in the weight, but every row depends on the mean of the call's rows."""

    def forward(self, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
        centred = hidden_states - hidden_states.mean(0, keepdim=True)
        y = torch.einsum("tkoi,ti->tko", self.up[top_k_index], centred)
        return (y * top_k_weights.unsqueeze(-1)).sum(1)


class _InterleavedFlatRows(nn.Module):
    """Flat rows in a child (like DBRX's ``mlp.w1`` [E*k, H]) whose expert e is rows e, e+E, ...
    rather than the block e*k..(e+1)*k-1 that Shard(0) gives its owner."""

    def __init__(self, num_experts: int = 4, hidden: int = 8, k: int = 2) -> None:
        super().__init__()
        self.num_experts, self.k = num_experts, k
        self.mlp = nn.Module()
        self.mlp.w = nn.Parameter(torch.randn(num_experts * k, hidden))

    def forward(self, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
        w = cast(torch.Tensor, self.mlp.w).view(self.k, self.num_experts, -1)[:, top_k_index]  # [k, T, K, H]
        y = F.silu(torch.einsum("jtki,ti->tkj", w, hidden_states))
        return (torch.einsum("tkj,jtki->tki", y, w) * top_k_weights.unsqueeze(-1)).sum(1)


class _Block(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts


def _probe_rank(kind: str) -> str:
    ctx = MeshContext.build(ParallelismSizes(ep_size=2))
    torch.manual_seed(0)
    experts = {"weight": _WeightBeforeActivation, "rows": _MixesRows, "flat": _InterleavedFlatRows}[kind]
    block = _Block(experts())
    apply_ep(block, ep_mesh=ctx.get_mesh("ep"))
    x = torch.randn(6, 8)
    idx = torch.randint(0, 4, (6, 2), generator=torch.Generator().manual_seed(dist.get_rank()))
    try:
        block.experts(x, idx, torch.rand(6, 2))
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "name", "reason"),
    [
        ("weight", "_WeightBeforeActivation", "not the expert output scaled by the routing weight"),
        ("rows", "_MixesRows", "depends on other rows"),
        ("flat", "_InterleavedFlatRows", "parameter row e does not compute expert e"),
    ],
)
def test_probe_refuses_forward_that_cannot_be_split(kind: str, name: str, reason: str) -> None:
    """Every rank raises (no rank is left waiting in an all-to-all), naming the class and the reason."""
    for message in run_on_ranks(_probe_rank, world_size=2, args=(kind,), timeout_s=120):
        assert f"cannot run {name}'s own forward" in message and reason in message, message


def _empty_owner_rank() -> float:
    """Every token routed to rank 0's experts: rank 1 receives nothing yet joins every collective."""
    ctx = MeshContext.build(ParallelismSizes(ep_size=2))
    rank = dist.get_rank()
    torch.manual_seed(0)
    block = _Block(_LinearInWeight())
    ref = copy.deepcopy(block.experts)
    apply_ep(block, ep_mesh=ctx.get_mesh("ep"))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 8, generator=g, requires_grad=True)
    idx = torch.randint(0, 2, (6, 2), generator=g)  # experts 0 and 1 live on rank 0
    w = torch.rand(6, 2, generator=g)
    x_ref = x.detach().clone().requires_grad_()
    out, want = block.experts(x, idx, w), ref(x_ref, idx, w)
    out.square().sum().backward()
    want.square().sum().backward()
    ref_grad = ref.get_parameter("up").grad
    ep_grad = block.experts.get_parameter("up").grad
    assert isinstance(ref_grad, torch.Tensor) and isinstance(ep_grad, DTensor)
    ref_grad = ref_grad.clone()
    dist.all_reduce(ref_grad)  # each rank's reference saw only its own tokens
    return max(_rel(out, want), _rel(x.grad, x_ref.grad), _rel(ep_grad.full_tensor(), ref_grad))


def test_owner_without_rows_still_runs_the_collectives() -> None:
    assert max(run_on_ranks(_empty_owner_rank, world_size=2, timeout_s=120)) <= TOL


# ---- the support rule, on meta-device models ------------------------------------------------
@pytest.mark.parametrize(
    ("family", "layout", "params"),
    [
        (
            "gpt_oss",
            ExpertsLayout.INDEX_ROUTED,
            ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
        ),
        ("nemotron_h", ExpertsLayout.INDEX_ROUTED, ("up_proj", "down_proj")),
        ("llama4_text", ExpertsLayout.EXPERT_BLOCKS, ("gate_up_proj", "down_proj")),
        ("jetmoe", ExpertsLayout.SORTED_ROWS, ("weight",)),
        ("mixtral", ExpertsLayout.SWIGLU, ("gate_up_proj", "down_proj")),
        ("doge", ExpertsLayout.EXPERT_ROWS, ("weight",)),
        ("dbrx", ExpertsLayout.INDEX_ROUTED, ("mlp.w1", "mlp.v1", "mlp.w2")),
    ],
)
def test_support_rule_classifies_layouts(family: str, layout: ExpertsLayout, params: tuple[str, ...]) -> None:
    blocks = check_expert_parallel_support(_build(family, meta=True))
    assert blocks and {(b.layout, b.param_names, b.num_experts) for b in blocks} == {(layout, params, 4)}


def test_support_rule_refusals() -> None:
    class _ZeroExperts(nn.Module):  # like LongcatFlashExperts: rows for identity experts only in gate_up_proj
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.empty(6, 8, 4))
            self.down_proj = nn.Parameter(torch.empty(4, 4, 4))

        def forward(self, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
            return hidden_states

    with pytest.raises(
        ValueError, match=r"_ZeroExperts.*different expert counts on dim 0.*rows 4\.\. of gate_up_proj"
    ):
        check_expert_parallel_support(_Block(_ZeroExperts()))

    class _PaddedTable(nn.Module):  # a padding row is not an expert's row
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.table = nn.Embedding(4, 8, padding_idx=0)

    with pytest.raises(ValueError, match=r"expert table 'table'.*padding_idx"):
        check_expert_parallel_support(_PaddedTable())

    class _PerExpertModules(nn.Module):  # one module per expert: rows of its [8, 8] weight are not experts
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.each = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    with pytest.raises(ValueError, match="has no experts module"):
        check_expert_parallel_support(_Block(_PerExpertModules()))
    with pytest.raises(ValueError, match="declares 4 experts but the built model has no experts module"):
        check_expert_parallel_support(_build("llama", meta=True), declared_experts=4)


def test_probe_rows_keep_a_sane_scale_on_placeholder_samples() -> None:
    """A pipeline stage's first call may carry NaN placeholders or never-written receive buffers
    (seen at 1e18): rows scaled by those overflowed in the experts and failed every check of a
    sound forward (flex_olmo ep2 x pp2, now and then); real hidden states keep their spread."""
    from automodel.moe.own_forward import _row_scale

    real = torch.randn(8, 16) * 0.7
    assert abs(_row_scale(real) - real.std().item()) < 1e-6
    assert _row_scale(torch.full((8, 16), float("nan"))) == 1.0
    assert _row_scale(torch.zeros(8, 16)) == 1.0
    garbage = torch.randn(8, 16) * 1e18
    assert _row_scale(garbage) == 1e2
