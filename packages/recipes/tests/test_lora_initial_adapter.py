"""``peft.initial_adapter``: LoRA starts from a Hugging Face PEFT adapter directory (both A and B as
they are in the file), the same on one process and under FSDP2, TP, PP and DDP; a directory that does not fit
the run's ``peft`` section is refused before launch, naming the key and what differs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from automodel.testing.layout_table import layouts_named
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _lora_helpers import lora_initial_adapters_on_rank  # noqa: E402
from _recipe_helpers import TINY, assert_losses_close, preload, tiny_config  # noqa: E402

preload()

TIMEOUT = 300
PEFT = {"dim": 4, "alpha": 8}
PREFIX = "base_model.model."


def _lora_meta_model(peft: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.recipes.peft import PeftSection, apply_lora

    cfg = dict(TINY["model"]["config"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    section = PeftSection(**peft)
    apply_lora(model, section=section)
    return model, section


def _write_adapter(directory: Path, *, r: int = 4, alpha: float = 8, drop: int = 0, **config) -> dict:
    """A PEFT adapter for TINY with PEFT's section: A and B random (B non-zero, so the model is not
    the base one; a fresh draw has B = 0), keys as peft writes them; `drop` leaves out that many
    tensors; `r`, `alpha` and `config` go to adapter_config.json."""
    model, _ = _lora_meta_model(PEFT)
    gen = torch.Generator().manual_seed(5)
    tensors = {
        n: torch.randn(tuple(p.shape), generator=gen) * 0.05
        for n, p in model.named_parameters()
        if ".lora_" in n
    }
    names = sorted(tensors)[drop:]
    directory.mkdir(parents=True)
    save_file({PREFIX + n: tensors[n] for n in names}, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha, **config})
    )
    return {n: tensors[n] for n in names}


# ---- refused before launch ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("write", "message"),
    [
        (None, "is not a local directory"),
        ({"r": 2}, r"r=2, but this run's peft\.dim=4"),
        ({"alpha": 16}, r"lora_alpha=16, but this run's peft\.alpha=8"),
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"drop": 1}, r"has no base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_A\.weight"),
    ],
)
def test_an_adapter_that_does_not_fit_is_refused_naming_the_key(write, message, tmp_path: Path) -> None:
    from automodel.recipes import load_config
    from automodel.recipes.errors import ConfigError
    from automodel.recipes.preflight import check_run_files

    directory = tmp_path / "adapter"
    if write is not None:
        _write_adapter(directory, **write)
    cfg = load_config(tiny_config(str(tmp_path / "run"), peft={**PEFT, "initial_adapter": str(directory)}))
    with pytest.raises(ConfigError, match=rf"peft\.initial_adapter.*{message}"):
        check_run_files(cfg)


def test_an_adapter_for_other_modules_or_shapes_is_refused(tmp_path: Path) -> None:
    from automodel.recipes.errors import ConfigError
    from automodel.recipes.peft import check_initial_adapter

    _write_adapter(tmp_path / "a")
    attention_only, section = _lora_meta_model(
        {**PEFT, "target_modules": ["q_proj"], "initial_adapter": str(tmp_path / "a")}
    )
    with pytest.raises(
        ConfigError, match=r"peft\.initial_adapter.*holds model\.layers\.0\.mlp\.down_proj.*does not select"
    ):
        check_initial_adapter(section, attention_only)
    model, section = _lora_meta_model({**PEFT, "initial_adapter": str(tmp_path / "a")})
    check_initial_adapter(section, model)  # the matching section passes
    with pytest.raises(ConfigError, match=r"peft\.initial_adapter"):
        _lora_meta_model({**PEFT, "initial_adapter": ""})


# ---- the run starts from it, on every layout alike ---------------------------------------------------
STEPS = {"max_steps": 2, "val_every_steps": None}
A, O_A = "model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.o_proj.lora_A.weight"
#: layout -> (ranks, distributed section, what rank r holds: checked on its local adapter shards)
LAYOUTS = {
    layout.name: (layout.ranks, {"strategy": "fsdp2", **layout.distributed})
    for layout in layouts_named("fsdp2_dp2", "tp2", "pp2_1f1b", "ddp2")
}
APPLIED = {
    "fsdp2_dp2": lambda r, rank: r["local_shapes"][A] == (2, 64),  # half of A's rows on each rank
    "tp2": lambda r, rank: (
        r["local_shapes"][A] == (4, 64) and r["local_shapes"][O_A] == (4, 32)
    ),  # rowwise o_proj: A's columns
    "pp2_1f1b": lambda r, rank: (
        {n.split(".")[2] for n in r["adapters"]} == {str(rank)}
    ),  # stage r: layer r's adapters
    "ddp2": lambda r, rank: all(p is None for p in r["placements"].values()),  # whole plain tensors
}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    directory = tmp_path_factory.mktemp("initial") / "adapter"
    return directory, _write_adapter(directory)


@pytest.fixture(scope="module")
def one_process(adapter, tmp_path_factory: pytest.TempPathFactory) -> dict:
    peft = {**PEFT, "initial_adapter": str(adapter[0])}
    out = tmp_path_factory.mktemp("one")
    cfg = tiny_config(str(out), peft=peft, step_scheduler=STEPS, validation_dataset=None)
    (ref,) = run_on_ranks(lora_initial_adapters_on_rank, world_size=1, args=(cfg,), timeout_s=TIMEOUT)
    assert ref["adapters"].keys() == adapter[1].keys()
    for name, tensor in adapter[1].items():
        assert torch.equal(ref["adapters"][name], tensor), name
    return ref


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_run_starts_from_the_adapter_on_every_layout(
    name: str, adapter, one_process, tmp_path: Path
) -> None:
    """The adapters before step 1 are the file's, bit for bit (gathered from this layout's shards, on
    one process too), and the losses equal one process's; each rank holds what the layout says."""
    world, dist_section = LAYOUTS[name]
    peft = {**PEFT, "initial_adapter": str(adapter[0])}
    cfg = tiny_config(
        str(tmp_path), peft=peft, step_scheduler=STEPS, validation_dataset=None, distributed=dist_section
    )
    results = run_on_ranks(lora_initial_adapters_on_rank, world_size=world, args=(cfg,), timeout_s=TIMEOUT)
    held: set[str] = set()
    for rank, result in enumerate(results):
        for key, tensor in result["adapters"].items():
            assert torch.equal(tensor, adapter[1][key]), (name, rank, key)
        held |= result["adapters"].keys()
        assert APPLIED[name](result, rank), (name, rank, result["local_shapes"])
        assert_losses_close(result["losses"], one_process["losses"])
    assert held == adapter[1].keys()


def test_a_runs_own_saved_adapter_is_a_start(tmp_path: Path) -> None:
    """``step_N/adapter/`` of a LoRA run (this project's export) passes the checks and is the next
    run's start, bit for bit."""
    from safetensors.torch import load_file

    steps = {"max_steps": 1, "val_every_steps": None}
    first = tiny_config(
        str(tmp_path / "first"),
        peft=PEFT,
        step_scheduler=steps,
        validation_dataset=None,
        checkpoint={"enabled": True, "save_consolidated": False},
    )
    run_on_ranks(lora_initial_adapters_on_rank, world_size=1, args=(first,), timeout_s=TIMEOUT)
    adapter = tmp_path / "first" / "checkpoints" / "step_1" / "adapter"
    saved = {
        k.removeprefix(PREFIX): v for k, v in load_file(str(adapter / "adapter_model.safetensors")).items()
    }
    peft = {**PEFT, "initial_adapter": str(adapter)}
    second = tiny_config(str(tmp_path / "second"), peft=peft, step_scheduler=steps, validation_dataset=None)
    (result,) = run_on_ranks(lora_initial_adapters_on_rank, world_size=1, args=(second,), timeout_s=TIMEOUT)
    assert set(result["adapters"]) == set(saved)
    b = "model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.count_nonzero(saved[b]) > 0  # trained one step: not a fresh start
    for name, tensor in saved.items():
        assert torch.equal(result["adapters"][name], tensor), name
