"""Our Megatron datasets are megatron-core's, sample for sample: the same corpus, split, seq_length,
seed and sample count give token-for-token the samples of ``GPTDataset`` / ``BlendedDataset`` built
by megatron-core's own ``BlendedMegatronDatasetBuilder`` (document shuffle per epoch, windows across
documents, shuffle index, the separate final epoch, the blend interleave and per-corpus margins)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _corpus_helpers import Tok, random_docs, write_corpus  # noqa: E402

from automodel.data.batches import build_sampler  # noqa: E402
from automodel.data.blend_indices import blending_indices, normalize  # noqa: E402
from automodel.data.pretrain_build import build_megatron, megatron_length  # noqa: E402
from automodel.data.pretrain_sections import (  # noqa: E402
    MegatronPretrainingSection,
    MegatronPretrainingValidationSection,
)

SEQ = 16


def theirs(*, prefixes: list[str], weights: list[float] | None, split: str, sizes: list, seed: int) -> Any:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class MTok:  # what the config object reads of a tokenizer (pad -1: never a token, nothing masked)
        eod, pad, vocab_size, unique_identifiers = 0, -1, 512, {"class": "stub"}

    cfg = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=SEQ,
        blend=(prefixes, weights),
        split=split,
        tokenizer=MTok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,  # its BlendedDataset cache needs torch.distributed; GPTDataset caches by the corpus
    )
    return cast(Any, BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build())


def their_rows(ds: Any) -> list[list[int]]:
    return [ds[i]["tokens"].tolist() + ds[i]["labels"][-1:].tolist() for i in range(len(ds))]


def our_rows(ds: Any) -> list[list[int]]:
    return [ds.sample(i).tolist() for i in range(len(ds))]


def ours(paths: Any, *, split: str, seed: int, validation: bool = False, **kw: Any) -> Any:
    cls = MegatronPretrainingValidationSection if validation else MegatronPretrainingSection
    section = cls(paths=paths, seq_length=SEQ, split=split, seed=seed, **kw)
    return build_megatron(section, Tok(), packed_sequence_size=0, seed=99)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    tmp = tmp_path_factory.mktemp("corpora")
    return tmp, write_corpus(tmp / "a", random_docs(50)), write_corpus(tmp / "b", random_docs(80, seed=2))


@pytest.mark.parametrize("seed", [1, 7, 1234])
def test_one_corpus_train_and_validation(corpora: tuple[Path, str, str], seed: int) -> None:
    _, a, _ = corpora
    train, val, _ = theirs(prefixes=[a], weights=None, split="90,10,0", sizes=[None, None, None], seed=seed)
    mine, mine_val = ours(a, split="90,10,0", seed=seed), ours(a, split="90,10,0", seed=seed, validation=True)
    assert our_rows(mine) == their_rows(train) and len(mine) > 40
    assert our_rows(mine_val) == their_rows(val)


@pytest.mark.parametrize("num_samples", [130, 160])  # 3 epochs: the last shuffled apart (130) or not (160)
def test_sample_count_over_several_epochs(corpora: tuple[Path, str, str], num_samples: int) -> None:
    _, a, _ = corpora
    train, _, _ = theirs(prefixes=[a], weights=None, split="90,10,0", sizes=[num_samples, None, None], seed=3)
    mine = ours(a, split="90,10,0", seed=3, num_train_samples=num_samples)
    assert len(mine) >= num_samples and our_rows(mine) == their_rows(train)
    per_epoch = len(mine.order.document_index) // 3
    assert (
        sorted(mine.order.document_index[:per_epoch].tolist())
        != mine.order.document_index[:per_epoch].tolist()
    )


@pytest.mark.parametrize("seed", [1, 5])
def test_weighted_blend(corpora: tuple[Path, str, str], seed: int) -> None:
    _, a, b = corpora
    train, val, _ = theirs(
        prefixes=[a, b], weights=[30.0, 70.0], split="90,10,0", sizes=[100, 20, 0], seed=seed
    )
    paths = ["30", a, "70", b]
    mine = ours(paths, split="90,10,0", seed=seed, num_train_samples=100)
    mine_val = ours(paths, split="90,10,0", seed=seed, num_val_samples=20, validation=True)
    assert mine.dataset_index.tolist() == train.dataset_index.tolist()
    assert mine.counts.tolist() == [30, 70] and mine_val.counts.tolist() == [6, 14]
    assert [len(p) for p in mine.parts] == [len(d) for d in train.datasets]  # the 0.5 % margins
    assert our_rows(mine) == their_rows(train)
    assert our_rows(mine_val) == their_rows(val)


@pytest.mark.parametrize("size", [None, 50])
def test_unweighted_blend(corpora: tuple[Path, str, str], size: int | None) -> None:
    _, a, b = corpora
    train, _, _ = theirs(prefixes=[a, b], weights=None, split="1,0,0", sizes=[size, 0, 0], seed=2)
    mine = ours([a, b], split="1,0,0", seed=2, num_train_samples=size)
    assert our_rows(mine) == their_rows(train)


def test_blending_indices_equal_megatron_core_helpers() -> None:
    from megatron.core.datasets import helpers_cpp  # pyright: ignore[reportAttributeAccessIssue] (compiled)

    rng = np.random.default_rng(0)
    for weights, size in (([0.3, 0.7], 20000), ([0.2, 0.3, 0.5], 20000), (rng.random(7).tolist(), 20000)):
        w = normalize(normalize(weights))
        di, dsi = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers_cpp.build_blending_indices(di, dsi, np.array(w), len(w), size, False)
        a, b = blending_indices(w, size=size)
        assert a.tolist() == di.tolist() and b.tolist() == dsi.tolist()
    sizes = rng.integers(1, 3000, 5)
    di, dsi = np.zeros(int(sizes.sum()), np.int16), np.zeros(int(sizes.sum()), np.int64)
    helpers_cpp.build_exhaustive_blending_indices(di, dsi, sizes.astype(np.int64), 5)
    a, b = blending_indices((sizes / float(sizes.sum())).tolist(), size=int(sizes.sum()), caps=sizes.tolist())
    assert a.tolist() == di.tolist() and b.tolist() == dsi.tolist()
    t0 = time.perf_counter()
    blending_indices([0.3, 0.7], size=1_000_000)
    assert time.perf_counter() - t0 < 10  # two corpora: vectorised, not a per-sample loop


def test_first_epoch_is_megatron_order_then_reshuffled(corpora: tuple[Path, str, str]) -> None:
    """Global batch k of epoch 0 is megatron-core's samples k*gbs .. (k+1)*gbs-1 whatever the dp
    size; later epochs are a fresh permutation per (seed, epoch)."""
    _, a, _ = corpora
    mine = ours(a, split="1,0,0", seed=4)
    n, gbs = len(mine), 8
    for dp in (1, 2, 4):
        samplers = [
            build_sampler(
                mine, global_batch_size=gbs, local_batch_size=gbs // dp, dp_rank=r, dp_size=dp, seed=4
            )
            for r in range(dp)
        ]
        steps = [[i for s in samplers for mb in s.next_step() for i in mb] for _ in range(n // gbs + 1)]
        assert [i for step in steps[: n // gbs] for i in step] == list(range(n // gbs * gbs))
        assert sorted(steps[-1]) != steps[-1] or steps[-1] != list(range(gbs))
    order = mine.sample_order
    assert sorted(order.indices(epoch=1, start=0, stop=n)) == list(range(n))
    assert order.indices(epoch=1, start=0, stop=n) != order.indices(epoch=2, start=0, stop=n)


def test_index_mapping_dir_caches_the_order(tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a", random_docs(50))
    cache = tmp_path / "index_mapping"
    built = ours(a, split="1,0,0", seed=1, index_mapping_dir=str(cache))
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 4 and any(f.endswith("shuffle_index.npy") for f in files)
    loaded = ours(a, split="1,0,0", seed=1, index_mapping_dir=str(cache))
    assert isinstance(loaded.order.shuffle_index, np.memmap)
    assert our_rows(loaded) == our_rows(built)
    other_seed = ours(a, split="1,0,0", seed=2, index_mapping_dir=str(cache))
    assert our_rows(other_seed) != our_rows(built) and len(list(cache.iterdir())) == 8


@pytest.mark.parametrize(
    ("which", "kw"),
    [
        ("a", {}),
        ("a", {"num_train_samples": 130}),
        ("a", {"num_train_samples": 160}),
        ("a", {"validation": True}),
        ("weighted", {"num_train_samples": 100}),
        ("weighted", {}),
        ("unweighted", {}),
        ("unweighted", {"num_train_samples": 50}),
    ],
)
def test_length_before_launch_is_the_built_datasets(
    corpora: tuple[Path, str, str], which: str, kw: dict[str, Any]
) -> None:
    """`megatron_length` (the pre-launch count: no sample order built) is `len()` of the dataset."""
    _, a, b = corpora
    paths = {"a": a, "weighted": ["30", a, "70", b], "unweighted": [a, b]}[which]
    validation = kw.pop("validation", False)
    cls = MegatronPretrainingValidationSection if validation else MegatronPretrainingSection
    section = cls(paths=paths, seq_length=SEQ, split="90,10,0", seed=3, **kw)
    built = build_megatron(section, Tok(), packed_sequence_size=0, seed=99)
    assert megatron_length(section, vocab_size=Tok().vocab_size, seq=SEQ) == len(built) > 0
