"""The public API's resume claim, in one process: a loader's `state_dict()` saved on 2 dp ranks and
loaded into loaders for 1 and for 4 continues the same global sample sequence as an uninterrupted
2-rank run, for a Megatron corpus, a weighted blend of two and nanoGPT shards (shuffled per epoch);
a streaming loader refuses another dp size with a `ConfigError` naming ``dataset.source``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _corpus_helpers import random_docs, write_corpus  # noqa: E402

from automodel.data import (  # noqa: E402
    ByteTokenizer,
    ConfigError,
    DataSection,
    MegatronPretrainingSection,
    NanogptSection,
    StreamingSection,
    Vocab,
    build_dataset,
    build_loader,
)
from automodel.data.nanogpt_shard import write_nanogpt_shard  # noqa: E402

GLOBAL, SEED = 8, 5


def _global_steps(
    section: DataSection, *, dp: int, steps: int, state: dict | None = None
) -> tuple[list, dict]:
    """`steps` global batches read by `dp` loaders (rank order), and the position after them."""
    dataset = build_dataset(section, tokenizer=Vocab(vocab_size=512, eos_token_id=0), seed=SEED)
    loaders = [
        build_loader(dataset, global_batch_size=GLOBAL, local_batch_size=1, dp_rank=r, dp_size=dp, seed=SEED)
        for r in range(dp)
    ]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        rows = [row for loader in loaders for b in loader.next_step() for row in b.input_ids.tolist()]
        out.append(rows)
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states)  # the position is global: every rank saves the same
    return out, states[0]


def _sections(tmp: Path) -> dict[str, DataSection]:
    a = write_corpus(tmp / "a", random_docs(60, seed=1))
    b = write_corpus(tmp / "b", random_docs(90, seed=2))
    rng = np.random.default_rng(3)
    for i in range(3):
        write_nanogpt_shard(tmp / f"shard_{i}.bin", rng.integers(1, 500, 700).astype(np.uint16))
    return {
        "megatron": MegatronPretrainingSection(paths=a, seq_length=16, split="100,0,0", seed=SEED),
        "blend": MegatronPretrainingSection(
            blend=[{"path": a, "weight": 30}, {"path": b, "weight": 70}], seq_length=16, split="100,0,0"
        ),
        "nanogpt": NanogptSection(file_pattern=str(tmp / "shard_*.bin"), seq_len=16, shuffle_files=True),
    }


@pytest.mark.parametrize("kind", ["megatron", "blend", "nanogpt"])
def test_resume_on_1_and_4_ranks_continues_the_global_sequence(tmp_path: Path, kind: str) -> None:
    section = _sections(tmp_path)[kind]
    full, _ = _global_steps(section, dp=2, steps=12)  # the Megatron corpus: 10 steps an epoch, so a new epoch
    first, state = _global_steps(section, dp=2, steps=4)
    second, state = _global_steps(section, dp=1, steps=4, state=state)
    third, _ = _global_steps(section, dp=4, steps=4, state=json.loads(json.dumps(state)))
    assert first + second + third == full
    assert len({tuple(r) for step in full for r in step}) > 8  # not one repeated sample


def test_streaming_refuses_another_dp_size_by_name(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    for i in range(2):
        (tmp_path / f"part_{i}.jsonl").write_text(
            "".join(json.dumps({"text": f"document {i}-{j} " * 20}) + "\n" for j in range(30))
        )
    section = StreamingSection(path=str(tmp_path / "*.jsonl"), seq_length=16)
    dataset = build_dataset(section, tokenizer=ByteTokenizer())
    loader = build_loader(dataset, global_batch_size=4, local_batch_size=1, dp_rank=0, dp_size=2, seed=0)
    loader.next_step()
    state = loader.state_dict()
    other = build_loader(dataset, global_batch_size=4, local_batch_size=1, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(
        ConfigError, match=r"^dataset\.source='streaming': cannot resume exactly on dp rank 0 of 1"
    ):
        other.load_state_dict(state)


def test_a_position_from_a_dataset_of_another_length_is_refused(tmp_path: Path) -> None:
    """The position counts the dataset's rows: loaded into a loader over another corpus it would
    silently point elsewhere, so it is refused naming both lengths."""
    short = write_corpus(tmp_path / "short", random_docs(60, seed=1))
    longer = write_corpus(tmp_path / "long", random_docs(90, seed=2))
    loaders = []
    for prefix in (short, longer):
        section = MegatronPretrainingSection(paths=prefix, seq_length=16, split="100,0,0", seed=SEED)
        dataset = build_dataset(section, tokenizer=Vocab(vocab_size=512, eos_token_id=0), seed=SEED)
        loaders.append(
            build_loader(
                dataset, global_batch_size=GLOBAL, local_batch_size=4, dp_rank=0, dp_size=2, seed=SEED
            )
        )
    loaders[0].next_step()
    state = loaders[0].state_dict()
    assert set(state) == {"epoch", "batch_in_epoch", "seed", "num_rows", "global_batch_size"}
    assert state["batch_in_epoch"] == 1
    rows = (state["num_rows"], loaders[1].state_dict()["num_rows"])
    assert rows[0] != rows[1]
    with pytest.raises(
        ValueError, match=rf"^sampler state is for {rows[0]} rows, this dataset has {rows[1]}$"
    ):
        loaders[1].load_state_dict(state)


def test_a_position_under_another_global_batch_size_is_refused(tmp_path: Path) -> None:
    """The position counts global batches: loaded under another global batch size it would name
    other samples, so it is refused naming both sizes."""
    prefix = write_corpus(tmp_path / "c", random_docs(60, seed=1))
    section = MegatronPretrainingSection(paths=prefix, seq_length=16, split="100,0,0", seed=SEED)
    dataset = build_dataset(section, tokenizer=Vocab(vocab_size=512, eos_token_id=0), seed=SEED)
    saved = build_loader(dataset, global_batch_size=8, local_batch_size=4, dp_rank=0, dp_size=2, seed=SEED)
    saved.next_step()
    other = build_loader(dataset, global_batch_size=4, local_batch_size=2, dp_rank=0, dp_size=2, seed=SEED)
    with pytest.raises(ValueError, match=r"^sampler state is for global_batch_size=8, this loader's is 4: "):
        other.load_state_dict(saved.state_dict())


def test_a_bad_section_value_is_a_config_error_naming_key_and_value() -> None:
    """Sections validate on creation: a `ConfigError` (a `ValueError`) whose one line names both."""
    with pytest.raises(ConfigError) as e:
        MegatronPretrainingSection(paths="corpus", seq_length=1)
    assert isinstance(e.value, ValueError) and str(e.value) == "dataset.seq_length=1: must be an int >= 2"
    with pytest.raises(ConfigError, match=r"^dataset\.shuffle_files='yes': must be true or false$"):
        NanogptSection(file_pattern="shard_*.bin", shuffle_files="yes")
