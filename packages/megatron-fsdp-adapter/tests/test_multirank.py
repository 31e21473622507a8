"""Real gloo ranks: layout rules, the mesh axes megatron-fsdp is given, the no-CUDA error, TP-only parity."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from automodel.megatron_fsdp import MegatronFSDPConfig, MegatronFSDPManager, MegatronFSDPUnavailableError
from automodel.mesh import MeshContext, ParallelismSizes
from automodel.testing.ranks import cuda_device_count, run_on_ranks
from automodel.testing.tiny_model import tiny_llama

TIMEOUT_S = 300


def _layout_errors() -> list[str]:
    messages = []
    for sizes in (
        ParallelismSizes(pp_size=2),
        ParallelismSizes(ep_size=2),
        ParallelismSizes(dp_replicate_size=2),
    ):
        ctx = MeshContext.build(sizes)
        try:
            MegatronFSDPManager(MegatronFSDPConfig(), ctx)
            messages.append("accepted")
        except ValueError as err:
            messages.append(str(err))
    ctx = MeshContext.build(ParallelismSizes())  # dp=4: megatron-fsdp can sum (1.0) or average (4), not /3
    for factor in (3.0, 1.0):
        try:
            MegatronFSDPManager(MegatronFSDPConfig(), ctx, gradient_divide_factor=factor)
            messages.append("accepted")
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_seed_layout_rules_are_value_errors() -> None:
    for messages in run_on_ranks(_layout_errors, world_size=4, timeout_s=TIMEOUT_S):
        assert "pp_size=2" in messages[0]
        assert "ep_size=2" in messages[1]
        assert "dp_replicate_size=2" in messages[2]
        assert "gradient_divide_factor=3.0" in messages[3] and "4" in messages[3]
        assert messages[4] == "accepted"


def _axes_and_megatron_groups() -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron_fsdp import FSDPDistributedIndex
    out = []
    for tp, cp in ((1, 1), (2, 1), (1, 2)):
        ctx = MeshContext.build(ParallelismSizes(tp_size=tp, cp_size=cp))
        axes = MegatronFSDPManager(MegatronFSDPConfig(), ctx).axes
        # megatron-fsdp's own index over the mesh and names we hand it (no CUDA needed to build it).
        index = FSDPDistributedIndex(
            device_mesh=ctx.device_mesh, dp_shard_dim=axes.dp_shard_dim, tp_dim=axes.tp_dim
        )
        out.append(
            {
                "axis": axes.dp_shard_dim,
                "size": axes.dp_group_size,
                "fsdp_group": dist.get_process_group_ranks(index.get_dp_group()),
                "tp_group": dist.get_process_group_ranks(index.get_submesh(axes.tp_dim).get_group()),
                "expected_fsdp_group": ctx.layout.group_ranks(dist.get_rank(), axes.dp_shard_dim),
            }
        )
    return out


def test_megatron_fsdp_gets_dp_or_dp_cp_and_tp() -> None:
    results = run_on_ranks(_axes_and_megatron_groups, world_size=4, timeout_s=TIMEOUT_S)
    for rank, (plain, with_tp, with_cp) in enumerate(results):
        assert (plain["axis"], plain["size"], plain["fsdp_group"]) == ("dp", 4, [0, 1, 2, 3])
        assert plain["tp_group"] == [rank]
        assert (with_tp["axis"], with_tp["size"]) == ("dp", 2)
        assert with_tp["fsdp_group"] == [rank % 2, rank % 2 + 2]
        assert with_tp["tp_group"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert (with_cp["axis"], with_cp["size"], with_cp["fsdp_group"]) == ("dp_cp", 4, [0, 1, 2, 3])
        for layout in (plain, with_tp, with_cp):
            assert layout["fsdp_group"] == layout["expected_fsdp_group"]


def _no_cuda_message() -> str:
    ctx = MeshContext.build(ParallelismSizes(tp_size=1))
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        MegatronFSDPManager(MegatronFSDPConfig(), ctx).parallelize(
            model, torch.optim.AdamW(model.parameters())
        )
    except MegatronFSDPUnavailableError as err:
        untouched = all(
            torch.equal(p, before[n]) and not isinstance(p, DTensor) for n, p in model.named_parameters()
        )
        return f"{err} | untouched={untouched}"
    return "no error"


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the message on machines without CUDA")
def test_no_cuda_is_a_clear_error() -> None:
    for message in run_on_ranks(_no_cuda_message, world_size=2, timeout_s=TIMEOUT_S):
        assert "needs CUDA" in message and "torch.cuda.is_available() is False" in message
        assert "fsdp2" in message and message.endswith("untouched=True")


def _fresh_import() -> tuple[bool, bool]:
    """In a forked rank: forget megatron_fsdp, transformers and this package, then import it anew."""
    for name in list(sys.modules):
        if name.split(".")[0] in ("megatron_fsdp", "transformers") or name.startswith(
            "automodel.megatron_fsdp"
        ):
            del sys.modules[name]
    importlib.import_module("automodel.megatron_fsdp")
    return "megatron_fsdp" in sys.modules, "transformers" in sys.modules


def test_import_does_not_import_megatron_fsdp_or_transformers() -> None:
    assert run_on_ranks(_fresh_import, world_size=1, timeout_s=TIMEOUT_S) == [(False, False)]


MLP_ONLY_PLAN = {
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def _train(model, optimizer, steps: int = 3) -> list[float]:
    losses = []
    ids = torch.randint(
        0, 256, (2, 16), generator=torch.Generator().manual_seed(100)
    )  # one batch: loss must fall
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _tp_only(config_kwargs: dict) -> dict:
    ctx = MeshContext.build(ParallelismSizes(tp_size=2))
    reference = tiny_llama()
    ref_losses = _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1))
    model = tiny_llama()
    manager = MegatronFSDPManager(MegatronFSDPConfig(**config_kwargs), ctx)
    manager.apply_tp_and_checkpointing(model)  # what precedes megatron-fsdp; runs without CUDA
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    layer = model.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer), type(layer)
    mlp = getattr(layer.mlp, "_checkpoint_wrapped_module", layer.mlp)
    return {
        "ref": ref_losses,
        "tp": _train(model, optimizer),
        "mlp_sharded": isinstance(mlp.gate_proj.weight, DTensor),
        "attn_sharded": isinstance(layer.self_attn.q_proj.weight, DTensor),
        "mlp_checkpointed": hasattr(layer.mlp, "_checkpoint_wrapped_module"),
    }


@pytest.mark.parametrize(
    "config_kwargs,attn_sharded",
    [({}, True), ({"activation_checkpointing": True}, True), ({"tp_plan": MLP_ONLY_PLAN}, False)],
    ids=["tp", "tp+ac", "custom-plan"],
)
def test_tp_and_checkpointing_before_megatron_fsdp_match_one_process(
    config_kwargs: dict, attn_sharded: bool
) -> None:
    for result in run_on_ranks(_tp_only, world_size=2, args=(config_kwargs,), timeout_s=TIMEOUT_S):
        assert result["mlp_sharded"] and result["attn_sharded"] is attn_sharded
        assert result["mlp_checkpointed"] is bool(config_kwargs.get("activation_checkpointing"))
        torch.testing.assert_close(result["tp"], result["ref"], rtol=1e-5, atol=0)
        assert result["ref"][-1] < result["ref"][0]
