"""SFT micro-batches as long as their longest example (rounded up to a small multiple), not
``seq_length``: the batch tensors are that long, the loss of every step (and validation) equals the
loss with rows padded to ``seq_length`` on multi-rank layouts, pipeline parallelism keeps rows of
``seq_length`` (fixed-shape stages), and compiled layers see a bounded number of shapes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from automodel.data.sft import PAD_MULTIPLE, BatchLength
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import assert_losses_close, preload, tiny_config  # noqa: E402
from _sft_helpers import arithmetic_instruction_section  # noqa: E402

preload()

TIMEOUT = 300
#: Rows of 256 tokens; the arithmetic examples are ~10 bytes, so a micro-batch is one multiple long.
SEQ = 256


def _config(tmp: Path, out: str, **sections: Any) -> dict:
    dataset = arithmetic_instruction_section(tmp, seq_length=SEQ)
    cfg = tiny_config(out, step_scheduler={"max_steps": 2, "val_every_steps": 2}, **sections)
    cfg["dataset"] = dataset
    cfg["validation_dataset"] = {**dataset, "limit_dataset_samples": 16}
    return cfg


def _real_length(labels: torch.Tensor) -> int:
    """The longest example of a micro-batch: its last label (each example's EOS) + 1."""
    cols = torch.nonzero((labels != -100).any(dim=0)).flatten()
    return int(cols.max()) + 1


def _train_recording(raw: dict, pad_multiple: int | None) -> dict[str, Any]:
    """Rank function: train `raw` (with `pad_multiple` replacing `PAD_MULTIPLE`: ``SEQ`` pads every
    row to seq_length as before), recording each micro-batch's length and longest example."""
    import automodel.recipes.trainer as trainer_module
    from automodel.recipes import load_config

    if pad_multiple is not None:
        trainer_module.PAD_MULTIPLE = pad_multiple
    trainer = trainer_module.Trainer(load_config(raw))
    trainer.build()
    seen: list[tuple[int, int]] = []
    next_step = trainer.loader.next_step

    def recording() -> list:
        batches = next_step()
        seen.extend((b.input_ids.shape[1], _real_length(b.labels)) for b in batches)
        return batches

    trainer.loader.next_step = recording
    result = trainer.train()
    assert trainer.val_dataset is not None
    _, val_labels, _ = trainer.val_dataset.batch([0, 1])
    layout = trainer.mesh.layout
    return {
        "losses": result.losses + [result.val_losses[k] for k in sorted(result.val_losses)],
        "seen": seen,
        "val_length": (val_labels.shape[1], _real_length(val_labels)),
        "layout": {"dp": layout.dp, "tp": layout.tp, "cp": layout.cp, "pp": layout.pp},
        "notes": trainer.cfg.notes,
    }


@pytest.fixture(scope="module")
def padded_reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """One process, every row padded to seq_length (today's rows before this change)."""
    tmp = tmp_path_factory.mktemp("padded_ref")
    (ref,) = run_on_ranks(
        _train_recording, world_size=1, args=(_config(tmp, str(tmp / "out")), SEQ), timeout_s=TIMEOUT
    )
    assert all(n == SEQ for n, _ in ref["seen"]), ref["seen"]
    return ref["losses"]


LAYOUTS = {
    "dp2": ({"strategy": "fsdp2"}, {"dp": 2, "tp": 1, "cp": 1, "pp": 1}),
    "tp2_sp": (
        {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True},
        {"dp": 1, "tp": 2, "cp": 1, "pp": 1},
    ),
    "cp2": ({"strategy": "fsdp2", "cp_size": 2}, {"dp": 1, "tp": 1, "cp": 2, "pp": 1}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_batch_as_long_as_its_longest_example_same_loss(
    layout: str, padded_reference: list[float], tmp_path: Path
) -> None:
    section, sizes = LAYOUTS[layout]
    cfg = _config(tmp_path, str(tmp_path / "out"), distributed=section)
    for got in run_on_ranks(_train_recording, world_size=2, args=(cfg, None), timeout_s=TIMEOUT):
        assert got["layout"] == sizes  # the layout really applied
        rule = BatchLength(multiple=PAD_MULTIPLE)
        for length, longest in [*got["seen"], got["val_length"]]:
            assert length == rule.of(longest, cap=SEQ) == PAD_MULTIPLE < SEQ, got["seen"]
        assert_losses_close(got["losses"], padded_reference)
        assert max(abs(a - b) for a, b in zip(got["losses"], padded_reference, strict=True)) < 1e-6


def test_pipeline_keeps_rows_of_seq_length(padded_reference: list[float], tmp_path: Path) -> None:
    """Pipeline stages exchange fixed-shape activations: every micro-batch of every step is
    padded to seq_length, and a start-up note says so."""
    pp = {"strategy": "fsdp2", "pp_size": 2, "pipeline": {"pp_schedule": "1f1b", "pp_microbatch_size": 1}}
    cfg = _config(tmp_path, str(tmp_path / "out"), distributed=pp)
    for got in run_on_ranks(_train_recording, world_size=2, args=(cfg, None), timeout_s=TIMEOUT):
        assert got["layout"]["pp"] == 2
        assert {n for n, _ in got["seen"]} == {SEQ}
        assert got["val_length"][0] == SEQ
        assert any(f"padded to dataset.seq_length={SEQ}" in n for n in got["notes"]), got["notes"]
        assert_losses_close(got["losses"], padded_reference)


def test_packed_rows_stay_full(tmp_path: Path) -> None:
    """Packing is unchanged: rows of packed_sequence_size, however short their documents."""
    from automodel.data.sft import batch_length_rows
    from automodel.recipes import load_config
    from automodel.recipes.data import build_packed_dataset
    from automodel.recipes.data.launch_data import run_tokenizer

    cfg = load_config(_config(tmp_path, str(tmp_path / "out")))
    ds = build_packed_dataset(cfg.dataset, run_tokenizer(cfg), packed_sequence_size=128)
    assert batch_length_rows(ds, BatchLength(multiple=PAD_MULTIPLE)) is ds
    assert ds.batch([0])[0].shape == (1, 128)


def test_batch_length_rule() -> None:
    """Rounded up to the multiple, capped at the rows' width; buckets are the multiple times a
    power of two: lengths 1..1,000 in rows of 1,024 give at most 5 shapes."""
    rule = BatchLength(multiple=64)
    assert [rule.of(n, cap=1000) for n in (1, 64, 65, 200, 999)] == [64, 64, 128, 256, 1000]
    buckets = BatchLength(multiple=64, buckets=True)
    got = [buckets.of(n, cap=1000) for n in (1, 64, 65, 129, 200, 257, 999)]
    assert got == [64, 64, 128, 256, 256, 512, 1000]
    assert {buckets.of(n, cap=1024) for n in range(1, 1001)} == {64, 128, 256, 512, 1024}


def test_the_batch_multiple_is_the_layouts_sequence_divisor(tmp_path: Path) -> None:
    """The multiple a batch is rounded to is the one `check_model` refuses a seq_length by."""
    from automodel.recipes import load_config
    from automodel.recipes.parallelisms import sequence_length_divisor

    for dist, world, want in [
        ({"cp_size": 2}, 2, 4),
        ({"tp_size": 2, "sequence_parallel": True}, 2, 1),
        ({"tp_size": 2}, 2, 1),
        ({"cp_size": 2, "tp_size": 2, "sequence_parallel": True}, 4, 4),
    ]:
        cfg = load_config(_config(tmp_path, str(tmp_path / "out"), distributed={"strategy": "fsdp2", **dist}))
        layout = cfg.distributed.sizes.resolve(world)
        assert sequence_length_divisor(cfg.distributed, layout) == want, dist


def _compiles(lengths: list[int], *, dynamic: bool | None) -> int:
    """Graphs dynamo compiled (first compiles and recompiles) for forwards of a tiny Llama whose
    decoder layers are compiled as ``distributed.enable_compile`` compiles them, one forward per
    micro-batch length in `lengths`; counted by the backend, which dynamo calls once per graph."""
    from automodel.fsdp2.compile import apply_compile
    from automodel.testing.tiny_model import tiny_llama

    graphs = 0

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        nonlocal graphs
        graphs += 1
        return gm.forward

    torch.compiler.reset()
    model = tiny_llama(layers=2, max_position_embeddings=1024)
    apply_compile(model, backend=counting, dynamic=dynamic)  # type: ignore[arg-type]
    with torch.no_grad():
        for n in lengths:
            model(input_ids=torch.zeros(2, n, dtype=torch.long), use_cache=False)
    torch.compiler.reset()
    return graphs


@pytest.mark.heavy  # ~150 s on 2 cores: 17 dynamo compiles
def test_compiled_layers_see_a_bounded_number_of_shapes(capsys: pytest.CaptureFixture) -> None:
    """40 micro-batches whose longest examples vary from 3 to 1,000 tokens (rows of 1,024): with
    buckets (what a compiled run uses) the lengths are 64 * 2**k, at most 5 shapes; dynamo's
    compiles are counted and printed (the figures in docs/performance.md)."""
    longest = [int(x) for x in torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(0))]
    buckets = [BatchLength(multiple=64, buckets=True).of(n, cap=1024) for n in longest]
    multiples = [BatchLength(multiple=64).of(n, cap=1024) for n in longest]
    assert set(buckets) <= {64, 128, 256, 512, 1024}
    counts = {
        (name, dynamic): _compiles(lengths, dynamic=dynamic)
        for name, lengths in (("buckets", buckets), ("multiples", multiples))
        for dynamic in (None, False)
    }
    with capsys.disabled():
        print(
            f"\ncompiles over 40 micro-batches: {len(set(buckets))} bucket shapes, "
            f"{len(set(multiples))} multiple-of-64 shapes; {counts}"
        )
    # dynamic=None (the strategy's default): the first shape, then one dynamic-shape graph
    assert counts[("buckets", None)] <= 2
    # static shapes: one graph per distinct length (the layers share it), so buckets bound them
    # by log2(1024/64) + 1; the 15 multiples of 64 run into dynamo's recompile limit (8), after
    # which the layers run uncompiled
    assert counts[("buckets", False)] == len(set(buckets)) < counts[("multiples", False)]
