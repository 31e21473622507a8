"""User mistakes raise clear errors naming the key and the bad value."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from automodel.context_parallel import apply_context_parallel, make_cp_batch_and_ctx, resolve_backend
from automodel.context_parallel.backends import import_transformer_engine
from automodel.mesh import MeshContext, ParallelismSizes
from automodel.testing.ranks import RankFailure, cuda_device_count, run_on_ranks


def _build(cp_size: int) -> None:
    MeshContext.build(ParallelismSizes(cp_size=cp_size))


def test_cp_size_not_dividing_the_world():
    with pytest.raises(RankFailure, match="cp_size=3"):
        run_on_ranks(_build, world_size=2, args=(3,), timeout_s=300)


def _short_sequence() -> None:
    mesh = MeshContext.build(ParallelismSizes(cp_size=2))
    ids = torch.arange(3).unsqueeze(0)
    make_cp_batch_and_ctx(mesh.get_mesh("cp"), {"input_ids": ids, "labels": ids})


def test_sequence_shorter_than_two_cp():
    with pytest.raises(RankFailure, match="sequence length 3 is shorter than 2\\*cp_size=4"):
        run_on_ranks(_short_sequence, world_size=2, timeout_s=300)


def _packed_batch_of_two() -> None:
    mesh = MeshContext.build(ParallelismSizes(cp_size=2))
    ids = torch.arange(16).reshape(2, 8)
    batch = {"input_ids": ids, "labels": ids, "seq_lens": torch.tensor([[8], [8]])}
    make_cp_batch_and_ctx(mesh.get_mesh("cp"), batch)


def test_packed_sequences_need_local_batch_size_one():
    with pytest.raises(RankFailure, match="local_batch_size == 1.*got batch size 2"):
        run_on_ranks(_packed_batch_of_two, world_size=2, timeout_s=300)


def test_backend_and_rotation_names_are_checked():
    with pytest.raises(ValueError, match="backend must be one of .* got 'flash'"):
        resolve_backend("flash", device_type="cpu")
    with pytest.raises(ValueError, match="backend='torch' needs CUDA"):
        resolve_backend("torch", device_type="cpu")
    with pytest.raises(ValueError, match="backend='te' needs CUDA"):
        resolve_backend("te", device_type="cpu")
    assert resolve_backend("auto", device_type="cpu") == "ring"
    assert resolve_backend("auto", device_type="cuda") == "torch"
    with pytest.raises(ValueError, match="kv_rotation must be one of .* got 'alltoall'"):
        apply_context_parallel(torch.nn.Linear(2, 2), cp_mesh=None, kv_rotation="alltoall")
    with pytest.raises(ValueError, match="needs 'input_ids' and 'labels'"):
        make_cp_batch_and_ctx(None, {"input_ids": torch.zeros(1, 4)})


def _without_cp() -> tuple[str, int]:
    mesh = MeshContext.build(ParallelismSizes(cp_size=1))
    backend = apply_context_parallel(torch.nn.Linear(2, 2), cp_mesh=mesh.get_mesh("cp"))
    ids = torch.arange(6).unsqueeze(0)
    _, local = make_cp_batch_and_ctx(mesh.get_mesh("cp"), {"input_ids": ids, "labels": ids}, backend=backend)
    return backend, int(local["num_label_tokens"])


def test_cp_size_one_is_a_no_op():
    assert run_on_ranks(_without_cp, world_size=2, timeout_s=300) == [("none", 6), ("none", 6)]


def _model_without_attention() -> None:
    mesh = MeshContext.build(ParallelismSizes(cp_size=dist.get_world_size()))
    apply_context_parallel(torch.nn.Linear(2, 2), cp_mesh=mesh.get_mesh("cp"))


def test_model_without_attention_modules():
    with pytest.raises(RankFailure, match="no attention modules to make context-parallel"):
        run_on_ranks(_model_without_attention, world_size=2, timeout_s=300)


def test_missing_transformer_engine_says_how_to_install_it():
    # transformer-engine cannot be built without CUDA, so it is never present on CPU machines.
    if cuda_device_count() > 0:
        pytest.skip("CPU-only check")
    with pytest.raises(ImportError, match="automodel-context-parallel\\[te\\]"):
        import_transformer_engine()


class _OwnMatmulAttention(torch.nn.Module):
    """Attention by its own matmuls (as XGLM's is): the CP attention function never runs."""

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        scores = (hidden_states @ hidden_states.transpose(-1, -2)).softmax(-1)
        return scores @ hidden_states


class _OwnAttentionModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _OwnMatmulAttention()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.self_attn(hidden_states=x)


def test_attention_computed_by_the_module_itself_is_refused_before_launch():
    from automodel.context_parallel import check_context_parallel_support

    with pytest.raises(ValueError, match="computes attention inside _OwnMatmulAttention"):
        check_context_parallel_support(_OwnAttentionModel(), seq_length=8)


def _tiny_meta_model(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **overrides)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_own_attention_beside_a_dispatching_one_is_refused():
    """GIT's text decoder computes its own attention while its (unused) vision tower dispatches to
    transformers: hooking the vision tower alone left the text attention per-chunk (8.5e-4 off)."""
    from automodel.context_parallel import check_context_parallel_support

    model = _tiny_meta_model(
        "git",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=256,
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
    )
    with pytest.raises(ValueError, match="computes attention inside GitAttention, GitSelfAttention"):
        check_context_parallel_support(model, seq_length=32)


def test_attention_flagged_non_causal_is_refused():
    """Gemma 4 with bidirectional attention: the module passes is_causal=False itself and the mask
    alone says what it attends to; the causal ring would change the model."""
    from automodel.context_parallel import check_context_parallel_support

    model = _tiny_meta_model(
        "gemma4_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=256,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=16,
        use_bidirectional_attention="all",
    )
    with pytest.raises(ValueError, match="Gemma4TextAttention declares is_causal=False"):
        check_context_parallel_support(model, seq_length=32)


def _own_attention_under_cp() -> None:
    mesh = MeshContext.build(ParallelismSizes(cp_size=dist.get_world_size()))
    model = _OwnAttentionModel()
    apply_context_parallel(model, cp_mesh=mesh.get_mesh("cp"))
    model(torch.randn(1, 4, 2))


def test_attention_that_bypasses_the_cp_function_fails_loudly_at_run_time():
    with pytest.raises(RankFailure, match="computed attention without transformers' attention functions"):
        run_on_ranks(_own_attention_under_cp, world_size=2, timeout_s=300)
