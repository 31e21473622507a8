"""Single-process checks: config validation, schedule names, stage arithmetic, FQN splitting,
HF model validation, and the errors AutoPipeline raises for bad layouts (on a real 2-rank group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline import (
    AutoPipeline,
    PipelineConfig,
    check_parameter_coverage,
    hf_module_fqns_per_stage,
    known_schedule_names,
    num_stages_for,
    resolve_schedule,
    split_layers_evenly,
    split_module,
    stage_ids_this_rank,
    validate_hf_model_for_pipeline_support,
)
from automodel.testing.ranks import run_on_ranks
from automodel.testing.tiny_model import tiny_llama


# ---- config -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "torch_name"),
    [
        ("1f1b", "1F1B"),
        ("gpipe", "GPipe"),
        ("interleaved1f1b", "Interleaved1F1B"),
        ("interleaved_1f1b", "Interleaved1F1B"),
        ("looped_bfs", "LoopedBFS"),
        ("interleaved_zb", "InterleavedZeroBubble"),
        ("zbv", "ZBVZeroBubble"),
        ("dualpipev", "DualPipeV"),
        ("ScheduleInterleavedZeroBubble", "InterleavedZeroBubble"),
        ("ZBVZeroBubble", "ZBVZeroBubble"),
    ],
)
def test_schedule_names_resolve(name: str, torch_name: str) -> None:
    spec = resolve_schedule(name)
    assert spec.name == torch_name
    from torch.distributed.pipelining import schedules

    assert spec.cls is getattr(schedules, f"Schedule{torch_name}")
    assert spec.multi_stage == (torch_name not in ("1F1B", "GPipe"))
    assert spec.v_shape == (torch_name in ("ZBVZeroBubble", "DualPipeV"))


def test_defaults_match_seed() -> None:
    cfg = PipelineConfig()
    assert (cfg.pp_schedule, cfg.pp_microbatch_size, cfg.pp_batch_size) == ("1f1b", 1, 1)
    assert cfg.scale_grads_in_schedule is False and cfg.dtype is None and cfg.n_microbatches == 1
    assert PipelineConfig(dtype="bf16").dtype is torch.bfloat16


def test_unknown_schedule_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="pp_schedule='1f2b'") as err:
        PipelineConfig(pp_schedule="1f2b")
    for name in ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"):
        assert name in str(err.value)
    assert set(known_schedule_names()) >= {"1f1b", "gpipe", "interleaved1f1b", "zbv", "dualpipev"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"pp_batch_size": 8, "pp_microbatch_size": 3},
            r"pp_batch_size=8 is not divisible by pp_microbatch_size=3 .*set pp_batch_size to a multiple "
            r"of it \(e.g. 6 or 9\) or pp_microbatch_size to a divisor of 8",
        ),
        ({"pp_microbatch_size": 0}, "pp_microbatch_size must be a positive int"),
        ({"pp_batch_size": -2}, "pp_batch_size must be a positive int"),
        ({"layers_per_stage": 0}, "layers_per_stage"),
        ({"round_virtual_stages_to_pp_multiple": "sideways"}, "round_virtual_stages_to_pp_multiple"),
        ({"pp_seq_len": 0}, "pp_seq_len"),
        ({"dtype": "int7"}, "dtype must be a torch dtype .*got 'int7'"),
        ({"scale_grads_in_schedule": "yes"}, "scale_grads_in_schedule"),
        ({"pp_schedule_csv": 3}, "pp_schedule_csv must be a path, got 3"),
        ({"module_fqns_per_model_part": [["a"], []]}, r"module_fqns_per_model_part\[1\]"),
        (
            {"module_fqns_per_model_part": [["a"]], "layers_per_stage": 2},
            "either module_fqns_per_model_part or layers_per_stage",
        ),
    ],
)
def test_bad_config_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineConfig(**kwargs)


def test_config_reads_no_disk_the_csv_check_does(tmp_path) -> None:
    """A missing schedule CSV is met where it is read (`check_schedule_csv`: the build, the recipes'
    pre-launch check), with the message the config gave before."""
    from automodel.pipeline.schedules import check_schedule_csv

    assert (
        PipelineConfig(pp_schedule_csv="/nonexistent/schedule.csv").pp_schedule_csv
        == "/nonexistent/schedule.csv"
    )
    with pytest.raises(
        ValueError, match=r"^pp_schedule_csv='/nonexistent/schedule.csv' does not exist or is not a file$"
    ):
        check_schedule_csv("/nonexistent/schedule.csv")
    (tmp_path / "s.csv").write_text("0F0\n")
    check_schedule_csv(tmp_path / "s.csv")


# ---- stage arithmetic -------------------------------------------------------------------
def test_stage_ids_round_robin_and_v_shape() -> None:
    assert [stage_ids_this_rank(pp_rank=r, pp_size=4, num_stages=8) for r in range(4)] == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    assert [stage_ids_this_rank(pp_rank=r, pp_size=4, num_stages=8, v_shape=True) for r in range(4)] == [
        [0, 7],
        [1, 6],
        [2, 5],
        [3, 4],
    ]
    assert stage_ids_this_rank(pp_rank=1, pp_size=2, num_stages=2) == [1]
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        stage_ids_this_rank(pp_rank=0, pp_size=2, num_stages=6, v_shape=True)


def test_layers_spread_evenly_remainder_first() -> None:
    assert [len(r) for r in split_layers_evenly(10, 4)] == [3, 3, 2, 2]
    assert [list(r) for r in split_layers_evenly(4, 2)] == [[0, 1], [2, 3]]


def test_num_stages_rules() -> None:
    assert num_stages_for(num_layers=8, pp_size=2, multi_stage=False) == 2
    assert num_stages_for(num_layers=8, pp_size=2, multi_stage=True) == 4
    assert num_stages_for(num_layers=8, pp_size=2, multi_stage=True, layers_per_stage=1) == 8
    assert (
        num_stages_for(
            num_layers=10, pp_size=2, multi_stage=True, layers_per_stage=4, round_to_pp_multiple="up"
        )
        == 4
    )
    with pytest.raises(ValueError, match="round_virtual_stages_to_pp_multiple"):
        num_stages_for(num_layers=10, pp_size=2, multi_stage=True, layers_per_stage=4)
    with pytest.raises(ValueError, match="multi-stage schedule but the layout gives 1 stage per rank"):
        num_stages_for(num_layers=8, pp_size=2, multi_stage=True, layers_per_stage=4)
    with pytest.raises(ValueError, match="single-stage schedule but the layout gives 2 stages per rank"):
        num_stages_for(num_layers=8, pp_size=2, multi_stage=False, layers_per_stage=2)
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        num_stages_for(num_layers=2, pp_size=4, multi_stage=False)


# ---- HF models --------------------------------------------------------------------------
def test_hf_fqns_embed_first_head_last_rotary_everywhere() -> None:
    parts = hf_module_fqns_per_stage(tiny_llama(layers=5), num_stages=2)
    assert parts == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.rotary_emb"],
        ["model.layers.3", "model.layers.4", "model.norm", "lm_head", "model.rotary_emb"],
    ]


def test_split_keeps_fqns_and_shares_modules() -> None:
    model = tiny_llama(layers=4)
    stage = split_module(model, fqns=["model.layers.2", "model.layers.3", "model.norm", "lm_head"])
    names = {n for n, _ in stage.named_parameters()}
    assert names == {
        n
        for n, _ in model.named_parameters()
        if not n.startswith(("model.embed", "model.layers.0.", "model.layers.1."))
    }
    assert stage.get_submodule("model").embed_tokens is None
    assert stage.get_submodule("model.layers")._modules.keys() == {"2", "3"}
    assert stage.lm_head is model.lm_head  # shared, not copied
    assert len(model.model.layers) == 4  # the model itself is untouched


def test_tied_embedding_is_held_by_first_and_last_stage() -> None:
    tied = tiny_llama(layers=4, tie_word_embeddings=True)
    structure = validate_hf_model_for_pipeline_support(tied)
    assert structure.tied_fqns == ("model.embed_tokens", "lm_head")
    parts = hf_module_fqns_per_stage(tied, num_stages=3, structure=structure)
    assert {"model.embed_tokens", "lm_head"} <= set(parts[0]) & set(parts[2])
    assert "model.norm" in parts[2] and "model.norm" not in parts[0]
    assert not {"model.embed_tokens", "lm_head"} & set(parts[1])


def test_validate_rejects_encoder_decoder_and_layerless() -> None:
    t5 = T5ForConditionalGeneration(
        T5Config(  # tie_word_embeddings: configs take extra keys at run time
            vocab_size=64,
            d_model=16,
            d_kv=4,
            d_ff=32,
            num_layers=1,
            num_heads=2,
            tie_word_embeddings=False,  # pyright: ignore[reportCallIssue]
        )
    )
    with pytest.raises(ValueError, match="encoder-decoder"):
        validate_hf_model_for_pipeline_support(t5)
    no_layers = tiny_llama(layers=2)
    setattr(no_layers.model, "layers", nn.Sequential(*no_layers.model.layers))  # noqa: B010 - not a ModuleList, on purpose
    with pytest.raises(ValueError, match="no ModuleList of decoder layers"):
        validate_hf_model_for_pipeline_support(no_layers)
    with pytest.raises(ValueError, match="no .config"):
        validate_hf_model_for_pipeline_support(nn.Linear(2, 2))
    validate_hf_model_for_pipeline_support(tiny_llama(layers=2))


def test_parameter_coverage_errors() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    check_parameter_coverage(model, [["0"], ["1", "2"]])
    with pytest.raises(ValueError, match=r"\['2.weight', '2.bias'\] are in no pipeline stage"):
        check_parameter_coverage(model, [["0"], ["1"]])
    with pytest.raises(ValueError, match="more than one pipeline stage"):
        check_parameter_coverage(model, [["0", "1"], ["1", "2"]])
    with pytest.raises(ValueError, match="names '7', which is not a submodule of Sequential"):
        check_parameter_coverage(model, [["0"], ["7"]])


# ---- AutoPipeline layout errors on a real pp group ---------------------------------------
def _build_error(config_kwargs: dict, model_kind: str) -> str:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    model = (
        tiny_llama(layers=4) if model_kind == "llama" else nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    )
    try:
        AutoPipeline(mesh=mesh, config=PipelineConfig(**config_kwargs)).build(model, loss_fn=None)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("config_kwargs", "model_kind", "match"),
    [
        (
            {"pp_schedule": "interleaved1f1b", "layers_per_stage": 2},
            "llama",
            "multi-stage schedule but the layout gives 1 stage per rank",
        ),
        (
            {"pp_schedule": "zbv", "module_fqns_per_model_part": [["0", "1"], ["2", "3"]]},
            "seq",
            "multi-stage schedule",
        ),
        (
            {"pp_schedule": "1f1b", "module_fqns_per_model_part": [["0"], ["1"], ["2"], ["3"]]},
            "seq",
            "single-stage schedule",
        ),
        (
            {"pp_schedule": "1f1b"},
            "seq",
            "not a Hugging Face transformers model, so its stages cannot be derived: set module_fqns_per_model_part",
        ),
        (
            {"pp_schedule": "1f1b", "pp_batch_size": 2, "module_fqns_per_model_part": [["0", "1"], ["3"]]},
            "seq",
            "in no pipeline stage",
        ),
        (  # torch's own error named neither key: "Number of microbatches (1) must be greater ..."
            {"pp_batch_size": 1, "module_fqns_per_model_part": [["0", "1"], ["2", "3"]]},
            "seq",
            "pp_batch_size=1 / pp_microbatch_size=1 gives 1 micro-batch, but 1F1B with 2 pipeline stages "
            "(pp_size=2) needs at least one micro-batch per stage (2): set pp_batch_size to at least 2",
        ),
        (
            {"pp_schedule": "dualpipev", "pp_batch_size": 6, "pp_microbatch_size": 2},
            "llama",
            "pp_batch_size=6 / pp_microbatch_size=2 gives 3 micro-batches, but DualPipeV with 4 pipeline "
            "stages (pp_size=2) needs at least one micro-batch per stage (4): set pp_batch_size to at "
            "least 8 (a multiple of pp_microbatch_size) or pp_microbatch_size to at most 1, or use gpipe",
        ),
        (
            {"pp_schedule": "interleaved1f1b", "pp_batch_size": 10, "pp_microbatch_size": 2},
            "llama",
            "pp_batch_size=10 / pp_microbatch_size=2 gives 5 micro-batches, but Interleaved1F1B with 4 "
            "pipeline stages (pp_size=2) runs micro-batches in rounds of equal size and needs a count that "
            "is a multiple of 2 (= 5 // pp_size); any multiple of pp_size works: set pp_batch_size to a "
            "multiple of pp_microbatch_size * pp_size = 4 (e.g. 8 or 12)",
        ),
        (
            {"pp_schedule": "interleaved_zb", "pp_batch_size": 5, "pp_microbatch_size": 1},
            "llama",
            "InterleavedZeroBubble with 4 pipeline stages (pp_size=2) runs micro-batches in rounds",
        ),
        (  # the config reads no disk: a missing schedule file is met when the pipeline is built
            {"pp_schedule": "1f1b", "pp_schedule_csv": "/nonexistent/schedule.csv"},
            "llama",
            "pp_schedule_csv='/nonexistent/schedule.csv' does not exist or is not a file",
        ),
    ],
)
def test_autopipeline_layout_errors(config_kwargs: dict, model_kind: str, match: str) -> None:
    messages = run_on_ranks(_build_error, world_size=2, args=(config_kwargs, model_kind), timeout_s=300)
    for message in messages:
        assert match in message


def _bad_step(case: str) -> str:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    config = PipelineConfig(
        pp_schedule="gpipe",
        pp_batch_size=4,
        pp_microbatch_size=2,
        module_fqns_per_model_part=[["0", "1"], ["2", "3"]],
    )
    pipe = AutoPipeline(mesh=mesh, config=config).build(model, loss_fn=lambda out, y: ((out - y) ** 2).sum())
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    try:
        if case == "batch":
            pipe.step(torch.randn(3, 4), labels=torch.randn(3, 4))
        elif case == "no_labels":
            pipe.step(x)
    except ValueError as e:
        pipe.step(x, labels=y)  # the pipeline still works after a rejected call
        return str(e)
    return "no error"


def test_step_input_errors() -> None:
    assert all(
        "pp_batch_size=4" in m for m in run_on_ranks(_bad_step, world_size=2, args=("batch",), timeout_s=300)
    )
    messages = run_on_ranks(_bad_step, world_size=2, args=("no_labels",), timeout_s=300)
    assert "labels is required" in messages[1]


def test_autopipeline_rejects_non_config() -> None:
    with pytest.raises(ValueError, match="config must be a PipelineConfig"):
        AutoPipeline(mesh=None, config={"pp_schedule": "1f1b"})  # type: ignore[arg-type]
