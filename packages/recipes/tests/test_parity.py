"""The same tiny config trained as 1 process and in every layout gives the same per-step losses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from automodel.recipes.strategies import get_strategy
from automodel.testing.layout_check import Q_PROJ, check_layout_applied, placement_on
from automodel.testing.layout_table import LAYOUTS as TABLE
from automodel.testing.layout_table import Layout, layouts_named
from automodel.testing.ranks import RankFailure, run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import MOE_MODEL, RTOL, TINY, assert_losses_close, preload, tiny_config, train_on_rank  # noqa: E402

preload()

TIMEOUT = 300


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    out = tmp_path_factory.mktemp("ref")
    (losses,) = run_on_ranks(train_on_rank, world_size=1, args=(tiny_config(str(out)),), timeout_s=TIMEOUT)
    assert losses[-1] < losses[0], losses
    return losses


def test_reference_is_independent_of_accumulation(reference: list[float], tmp_path: Path) -> None:
    cfg = tiny_config(str(tmp_path), step_scheduler={"local_batch_size": 8})
    (losses,) = run_on_ranks(train_on_rank, world_size=1, args=(cfg,), timeout_s=TIMEOUT)
    assert_losses_close(losses, reference)


@pytest.mark.parametrize("layout", TABLE, ids=[layout.name for layout in TABLE])
def test_the_table_says_replicated_exactly_when_the_strategy_copies_parameters(layout: Layout) -> None:
    """The strategy-blind checker trusts an entry's ``replicated``; it must match the strategy the
    section names (whose memory model shards the parameters over no axis)."""
    strategy = get_strategy(layout.distributed.get("strategy", TINY["distributed"]["strategy"]))
    memory = strategy.memory_model(strategy.config_class()())
    assert layout.replicated == (memory.shard_over == "none")


#: The shared layouts (`automodel.testing.layout_table`) on the recipes tests' 2-layer model: eight of
#: the parity matrix's, and two it does not run.
LAYOUTS = layouts_named(
    "fsdp2_dp2", "ddp2", "tp2", "tp2_sp", "hsdp_2x2", "fsdp2xtp_2x2", "pp2_1f1b", "cp2",
    "pp2xfsdp2_gpipe", "fsdp2_dp2_ac",
)  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_layout_matches_single_process(layout: Layout, reference: list[float], tmp_path: Path) -> None:
    cfg = tiny_config(str(tmp_path), distributed=layout.distributed, logging={"layout_report": "all"})
    results = run_on_ranks(train_on_rank, world_size=layout.ranks, args=(cfg,), timeout_s=TIMEOUT)
    for rank_losses in results:
        assert_losses_close(rank_losses, reference)
    reports = [
        json.loads((tmp_path / "layout" / f"rank_{rank}.json").read_text()) for rank in range(layout.ranks)
    ]
    # what every rank holds: with the parallelism switched off these checks fail
    check_layout_applied(
        reports,
        layout=layout,
        layers=TINY["model"]["config"]["num_hidden_layers"],
        num_experts=0,
    )


def _check_applied(output_dir: Path, layout: Layout, *, num_experts: int) -> None:
    """`check_layout_applied` on the reports a run with ``logging.layout_report: all`` wrote."""
    reports = [
        json.loads((output_dir / "layout" / f"rank_{r}.json").read_text()) for r in range(layout.ranks)
    ]
    layers = TINY["model"]["config"]["num_hidden_layers"]
    check_layout_applied(reports, layout=layout, layers=layers, num_experts=num_experts)


def test_moe_ep2_matches_single_process(tmp_path: Path) -> None:
    ref_cfg = tiny_config(str(tmp_path / "ref"), model=MOE_MODEL)
    (ref,) = run_on_ranks(train_on_rank, world_size=1, args=(ref_cfg,), timeout_s=TIMEOUT)
    (layout,) = layouts_named("ep2")
    cfg = tiny_config(
        str(tmp_path / "ep"),
        model=MOE_MODEL,
        distributed=layout.distributed,
        logging={"layout_report": "all"},
    )
    results = run_on_ranks(train_on_rank, world_size=2, args=(cfg,), timeout_s=TIMEOUT)
    # experts per rank, their local shapes and offsets: with EP switched off this fails
    _check_applied(tmp_path / "ep", layout, num_experts=MOE_MODEL["config"]["num_experts"])
    for rank_losses in results:
        assert_losses_close(rank_losses, ref)


def test_packed_sequences_cp2_match_single_process(tmp_path: Path) -> None:
    import json

    docs = tmp_path / "docs.jsonl"  # short documents, so every packed row holds several
    docs.write_text("\n".join(json.dumps({"text": f"doc {i}: " + "ab cd " * (i % 7)}) for i in range(600)))
    data = {"source": "json", "path": str(docs), "seq_length": 32}
    packed = {
        "packed_sequence": {"packed_sequence_size": 32},
        "step_scheduler": {"local_batch_size": 1},
        "dataset": data,
        "validation_dataset": data,
    }
    (ref,) = run_on_ranks(
        train_on_rank, world_size=1, args=(tiny_config(str(tmp_path / "r"), **packed),), timeout_s=TIMEOUT
    )
    (layout,) = layouts_named("cp2")
    cfg = tiny_config(
        str(tmp_path / "cp"), distributed=layout.distributed, logging={"layout_report": "all"}, **packed
    )
    results = run_on_ranks(train_on_rank, world_size=2, args=(cfg,), timeout_s=TIMEOUT)
    # the ring backend and every attention module's CP hooks: with CP switched off this fails
    _check_applied(tmp_path / "cp", layout, num_experts=0)
    for rank_losses in results:
        assert_losses_close(rank_losses, ref)
    unpacked = {**packed, "packed_sequence": {"packed_sequence_size": 0}}
    (plain,) = run_on_ranks(
        train_on_rank, world_size=1, args=(tiny_config(str(tmp_path / "u"), **unpacked),), timeout_s=TIMEOUT
    )
    assert abs(plain[0] - ref[0]) > 1e-4  # document masking changes the loss: the boundaries are real


def test_non_finite_loss_stops_naming_the_step(tmp_path: Path) -> None:
    cfg = tiny_config(
        str(tmp_path),
        optimizer={"_target_": "torch.optim.SGD", "lr": 1.0e30},
        clip_grad_norm={"max_norm": None},
    )
    with pytest.raises(RankFailure, match=r"NonFiniteError: step [23]: non-finite"):
        run_on_ranks(train_on_rank, world_size=1, args=(cfg,), timeout_s=TIMEOUT)


def test_pretrained_weights_are_loaded_into_every_layout(tmp_path: Path) -> None:
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.data.text_sections import DatasetSection
    from automodel.recipes.data import ByteTokenizer, StatefulGlobalBatchSampler, build_packed_dataset

    base = tiny_config(str(tmp_path / "unused"))
    hf_cfg = dict(base["model"]["config"])
    hf_config = AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    torch.manual_seed(123)
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")

    ds = build_packed_dataset(DatasetSection(**base["dataset"]), ByteTokenizer(), packed_sequence_size=0)
    sampler = StatefulGlobalBatchSampler(
        num_rows=len(ds), global_batch_size=8, local_batch_size=8, dp_rank=0, dp_size=1, seed=base["seed"]
    )
    ids, labels, _ = ds.batch(sampler.next_step()[0])
    with torch.no_grad():
        expected = F.cross_entropy(hf(input_ids=ids).logits.flatten(0, 1), labels.flatten()).item()

    model = {"config": None, "pretrained_path": str(tmp_path / "hf")}
    (ref,) = run_on_ranks(
        train_on_rank, world_size=1, args=(tiny_config(str(tmp_path / "r"), model=model),), timeout_s=TIMEOUT
    )
    assert abs(ref[0] - expected) <= RTOL * expected, (ref[0], expected)
    cfg = tiny_config(str(tmp_path / "d"), model=model, distributed={"strategy": "fsdp2", "tp_size": 2})
    for rank_losses in run_on_ranks(train_on_rank, world_size=2, args=(cfg,), timeout_s=TIMEOUT):
        assert_losses_close(rank_losses, ref)


def test_resume_from_checkpoint_continues_exactly(tmp_path: Path) -> None:
    steps = {"max_steps": 5, "val_every_steps": None, "ckpt_every_steps": 2}
    sched = {"decay_steps": 4}  # the first run stops at 3 of 5 steps: the schedule must not depend on it
    full = tiny_config(
        str(tmp_path / "full"),
        step_scheduler={**steps, "ckpt_every_steps": None},
        validation_dataset=None,
        lr_scheduler=sched,
    )
    (uninterrupted,) = run_on_ranks(train_on_rank, world_size=1, args=(full,), timeout_s=TIMEOUT)
    ckpt = {"enabled": True, "save_consolidated": False}
    first = tiny_config(
        str(tmp_path / "run"),
        step_scheduler={**steps, "max_steps": 3},
        validation_dataset=None,
        checkpoint=ckpt,
        lr_scheduler=sched,
    )
    run_on_ranks(train_on_rank, world_size=2, args=(first,), timeout_s=TIMEOUT)
    second = tiny_config(
        str(tmp_path / "run"),
        step_scheduler=steps,
        validation_dataset=None,
        checkpoint=ckpt,
        lr_scheduler=sched,
    )
    resumed = run_on_ranks(train_on_rank, world_size=2, args=(second,), timeout_s=TIMEOUT)[0]
    assert_losses_close(resumed, uninterrupted[3:])
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 5


TIED = {**TINY["model"]["config"], "tie_word_embeddings": True}


@pytest.mark.parametrize(
    ("model_type", "world", "dist_section"),
    [
        ("llama", 2, {"tp_size": 2, "sequence_parallel": True}),
        ("llama", 4, {"tp_size": 2}),
        ("qwen2", 2, {"tp_size": 2}),  # the model's own HF plan (its head is colwise there)
    ],
    ids=["llama_tp2_sp", "llama_dp2_tp2", "qwen2_tp2"],
)
def test_tied_embeddings_under_tp_match_single_process(
    model_type: str, world: int, dist_section: dict, tmp_path: Path
) -> None:
    """A tied embedding/head weight stays one replicated parameter over tp: sharding it once per
    owner would untie it and train two copies (2e-2 off one process before the fix)."""
    model = {"config": {**TIED, "model_type": model_type}}
    (ref,) = run_on_ranks(
        train_on_rank, world_size=1, args=(tiny_config(str(tmp_path / "r"), model=model),), timeout_s=TIMEOUT
    )
    cfg = tiny_config(
        str(tmp_path / "tp"),
        model=model,
        distributed={"strategy": "fsdp2", **dist_section},
        logging={"layout_report": "all"},
    )
    for rank_losses in run_on_ranks(train_on_rank, world_size=world, args=(cfg,), timeout_s=TIMEOUT):
        assert_losses_close(rank_losses, ref)
    for rank in range(world):
        report = json.loads((tmp_path / "tp" / "layout" / f"rank_{rank}.json").read_text())
        params = report["parts"][0]["parameters"]
        assert "lm_head.weight" not in params  # still the embedding's parameter (listed once)
        assert placement_on(params["model.embed_tokens.weight"], "tp") is None
        assert placement_on(params[Q_PROJ.format(i=0)], "tp") == "S(0)"


@pytest.mark.parametrize(
    ("world", "dist_section"),
    [
        (2, {"pp_size": 2, "pipeline": {"pp_schedule": "1f1b", "pp_microbatch_size": 1}}),
        (4, {"pp_size": 2, "tp_size": 2, "pipeline": {"pp_schedule": "gpipe", "pp_microbatch_size": 1}}),
        # V-shape: rank 0 holds the first and the last of 4 stages (copies summed in place)
        (2, {"pp_size": 2, "pipeline": {"pp_schedule": "zbvzerobubble", "pp_microbatch_size": 1}}),
    ],
    ids=["pp2_1f1b", "pp2_tp2", "pp2_zbv"],
)
def test_tied_embeddings_under_pp_match_single_process(
    world: int, dist_section: dict, tmp_path: Path
) -> None:
    """The first and the last stage each hold the tied embedding/head weight under its one name;
    their gradients are summed after backward, so both copies step alike and equal one process."""
    model = {"config": {**TIED, "model_type": "llama", "num_hidden_layers": 4}}
    (ref,) = run_on_ranks(
        train_on_rank, world_size=1, args=(tiny_config(str(tmp_path / "r"), model=model),), timeout_s=TIMEOUT
    )
    # every schedule validates too: the pipeline's eval is forward-only on its own (V shapes included)
    cfg = tiny_config(
        str(tmp_path / "pp"),
        model=model,
        distributed={"strategy": "fsdp2", **dist_section},
        logging={"layout_report": "all"},
    )
    for rank_losses in run_on_ranks(train_on_rank, world_size=world, args=(cfg,), timeout_s=TIMEOUT):
        assert_losses_close(rank_losses, ref)  # ref[3]: the validation loss
    for rank in range(world):
        report = json.loads((tmp_path / "pp" / "layout" / f"rank_{rank}.json").read_text())
        held = {name for part in report["parts"] for name in part["parameters"]}
        first_stage_here = any(name.startswith("model.layers.0.") for name in held)
        last_stage_here = any(name.startswith("model.layers.3.") for name in held)
        assert ("model.embed_tokens.weight" in held) == (first_stage_here or last_stage_here), sorted(held)
        assert "lm_head.weight" not in held  # the embedding's parameter, listed once
        assert ("model.norm.weight" in held) == last_stage_here, sorted(held)  # final norm: last stage only
