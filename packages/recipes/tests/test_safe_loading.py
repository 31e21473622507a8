"""Loading a checkpoint, a model directory or a tokenizer never runs code from it.

Every payload here creates a marker file when unpickled or imported; each test first proves its
payload is live (a plain ``pickle.loads`` / trusted import does create the marker), then that our
loading path refuses it or reads it without executing it (the marker never appears).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from automodel.recipes.checkpoint import CheckpointConfig, Checkpointer, CheckpointError, TrainingState
from automodel.recipes.checkpoint import paths as ckpt_paths
from automodel.recipes.checkpoint.convert_legacy import convert_legacy_checkpoint
from automodel.recipes.checkpoint.convert_legacy import main as convert_main
from automodel.recipes.checkpoint.pretrained import load_pretrained_weights
from automodel.recipes.checkpoint.safe_dcp import (
    MetadataUnpickler,
    SafeEmptyStateDictLoadPlanner,
    SafeFileSystemReader,
)
from automodel.recipes.checkpoint.state import decode_extra, encode_extra
from automodel.recipes.errors import ConfigError
from automodel.recipes.strategies.base import PLAIN_PARTS
from automodel.testing.ranks import run_on_ranks

TIMEOUT = 180


class Payload:
    """Unpickling this creates `marker`: a stand-in for arbitrary code in a crafted file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _assert_payload_is_live(tmp_path: Path) -> None:
    control = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(Payload(control)))
    assert control.is_file(), "the payload must run under a plain unpickler, else the tests prove nothing"


# ---- tiny model and one-rank training state ------------------------------------------------------
def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


class CountingLoader:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position, "name": "counting", "ratio": 0.1}

    def load_state_dict(self, sd: dict) -> None:
        self.position = sd["position"]


def _state(seed: int = 0) -> TrainingState:
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return TrainingState(
        model_parts=[model],
        optimizers=[opt],
        lr_schedulers=[sched],
        dataloader=CountingLoader(),
        step=0,
        strategy=PLAIN_PARTS,
    )


def _train(state: TrainingState, steps: int) -> None:
    model, opt, sched = state.model_parts[0], state.optimizers[0], state.lr_schedulers[0]
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 8))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        state.step += 1
        state.dataloader.position += 1


def _rng_fingerprint() -> tuple:
    return (random.random(), torch.rand(3).tolist(), float(np.random.rand()))


def _save_run(*, ckpt_dir: str) -> dict:
    """Rank body: train 2 steps, save, then report what the RNGs draw next."""
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    state = _state()
    _train(state, 2)
    ckpt = Checkpointer(
        CheckpointConfig(checkpoint_dir=ckpt_dir, save_consolidated=False), output_dir=ckpt_dir
    )
    ckpt.save(state)
    ckpt.close()
    params = {n: p.detach().clone() for n, p in state.model_parts[0].named_parameters()}
    return {"rng": _rng_fingerprint(), "params": params, "lr": state.lr_schedulers[0].get_last_lr()}


def _restore_run(*, restore_from: str, ckpt_dir: str) -> dict:
    """Rank body: restore `restore_from` into a fresh state; report step, RNG draws or the error."""
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    state = _state(seed=7)
    ckpt = Checkpointer(
        CheckpointConfig(checkpoint_dir=ckpt_dir, restore_from=restore_from, save_consolidated=False),
        output_dir=ckpt_dir,
    )
    try:
        step = ckpt.restore(state)
    except CheckpointError as err:
        return {"error": str(err)}
    finally:
        ckpt.close()
    params = {n: p.detach().clone() for n, p in state.model_parts[0].named_parameters()}
    return {
        "step": step,
        "position": state.dataloader.position,
        "rng": _rng_fingerprint(),
        "params": params,
        "lr": state.lr_schedulers[0].get_last_lr(),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("ck")
    out = run_on_ranks(_save_run, world_size=1, kwargs=dict(ckpt_dir=str(root)), timeout_s=TIMEOUT)
    return root / "step_2", out[0]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _full_state(path: Path) -> dict:
    state: dict = {}
    _load_state_dict(
        state,
        storage_reader=SafeFileSystemReader(str(path)),
        planner=SafeEmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return state


def _rewrite(path: Path, state: dict) -> None:
    """Re-save `state` as the DCP content of `path` and fix checkpoint.json's sizes, as an attacker would."""
    for f in path.iterdir():
        if f.name.endswith(".distcp") or f.name == ckpt_paths.DCP_METADATA_FILE:
            f.unlink()
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    _fix_sizes(path)


def _fix_sizes(path: Path, **changes) -> None:
    """checkpoint.json's sizes and checksums made to match the tampered files, as an attacker would
    (checksums catch corruption, not an attacker who can write checkpoint.json too)."""
    from automodel.recipes.checkpoint.integrity import CHECKSUMS_KEY, sha256_file

    info = json.loads((path / ckpt_paths.INFO_FILE).read_text())
    info.update(changes)
    info["files"] = {k: v for k, v in ckpt_paths.file_sizes(path).items() if k != ckpt_paths.INFO_FILE}
    info[CHECKSUMS_KEY] = {k: sha256_file(path / k) for k in info["files"]}
    (path / ckpt_paths.INFO_FILE).write_text(json.dumps(info))


# ---- the format itself -----------------------------------------------------------------------------
def test_encode_extra_round_trips_without_pickle():
    extra = {
        "step": 3,
        "nested": {"t": (1, 2.5, None), "x": [torch.arange(4), {"y": torch.ones(2, dtype=torch.bfloat16)}]},
        "nan": float("nan"),
        "flag": True,
        "text": "é",
    }
    entries = encode_extra(extra)
    assert all(isinstance(v, torch.Tensor) for v in entries.values())
    back = decode_extra(entries)
    assert back["step"] == 3 and back["flag"] is True and back["text"] == "é"
    assert back["nested"]["t"] == (1, 2.5, None)
    assert torch.equal(back["nested"]["x"][0], torch.arange(4))
    assert back["nested"]["x"][1]["y"].dtype == torch.bfloat16
    assert back["nan"] != back["nan"]
    with pytest.raises(ValueError, match=r"extra\.obj is a object"):
        encode_extra({"obj": object()})
    with pytest.raises(ValueError, match="non-string key"):
        encode_extra({"d": {1: 2}})


def test_saved_training_state_holds_no_pickle(saved):
    path, _ = saved
    metadata = SafeFileSystemReader(str(path)).read_metadata()
    extra = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith("extra_rank0")}
    assert "extra_rank0.json" in extra
    assert all(isinstance(v, TensorStorageMetadata) for v in extra.values()), extra
    info = json.loads((path / ckpt_paths.INFO_FILE).read_text())
    assert info["format_version"] == 2
    text = _full_state(path)["extra_rank0"]["json"].numpy().tobytes().decode()
    assert json.loads(text)["step"] == 2  # plain JSON, readable by anything


def test_restore_is_exact(saved, tmp_path):
    path, ref = saved
    out = run_on_ranks(
        _restore_run,
        world_size=1,
        kwargs=dict(restore_from=str(path), ckpt_dir=str(tmp_path)),
        timeout_s=TIMEOUT,
    )[0]
    assert out["step"] == 2 and out["position"] == 2
    assert out["rng"] == ref["rng"]  # python, torch and numpy RNG all restored
    assert out["lr"] == ref["lr"]
    for name, p in ref["params"].items():
        assert torch.equal(out["params"][name], p), name


# ---- crafted checkpoints ---------------------------------------------------------------------------
def _legacy_blob(extra: dict) -> bytes:
    """The format-1 blob: the same state as one pickle (python/numpy RNG as their native tuples)."""
    rng = extra["rng"]
    py, npy = rng["python"], rng["numpy"]
    old_rng = {
        "python": (py["version"], tuple(py["state"].tolist()), py["gauss_next"]),
        "torch": rng["torch"],
        "numpy": (
            npy["kind"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        ),
    }
    return pickle.dumps(dict(extra, rng=old_rng))


def test_malicious_legacy_training_state_is_refused_and_never_unpickled(saved, tmp_path):
    _assert_payload_is_live(tmp_path)
    marker = tmp_path / "pwned"
    path = _copy(saved[0], tmp_path / "step_2")
    state = _full_state(path)
    state["extra_rank0"] = pickle.dumps({"step": Payload(marker)})  # format 1's single pickled entry
    _rewrite(path, state)
    _fix_sizes(path, format_version=1)
    assert isinstance(
        SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata["extra_rank0"],
        BytesStorageMetadata,
    )
    out = run_on_ranks(
        _restore_run,
        world_size=1,
        kwargs=dict(restore_from=str(path), ckpt_dir=str(tmp_path)),
        timeout_s=TIMEOUT,
    )[0]
    assert "convert_legacy --trust-pickle" in out["error"] and "pickle" in out["error"]
    assert not marker.exists()


def test_malicious_non_tensor_entry_is_read_weights_only(saved, tmp_path):
    """A crafted object in a non-tensor DCP entry (torch would load it with weights_only=False)."""
    _assert_payload_is_live(tmp_path)
    marker = tmp_path / "pwned"
    path = _copy(saved[0], tmp_path / "step_2")
    state = _full_state(path)
    lr_keys = [k for k in state["optim"] if k.endswith(".lr")]
    assert lr_keys
    state["optim"][lr_keys[0]] = Payload(marker)
    _rewrite(path, state)
    out = run_on_ranks(
        _restore_run,
        world_size=1,
        kwargs=dict(restore_from=str(path), ckpt_dir=str(tmp_path)),
        timeout_s=TIMEOUT,
    )[0]
    assert "could not load checkpoint" in out["error"] and "Unpickling" in out["error"]
    assert not marker.exists()


def test_malicious_dcp_metadata_is_refused(saved, tmp_path):
    _assert_payload_is_live(tmp_path)
    marker = tmp_path / "pwned"
    path = _copy(saved[0], tmp_path / "step_2")
    (path / ckpt_paths.DCP_METADATA_FILE).write_bytes(pickle.dumps(Payload(marker)))
    _fix_sizes(path)
    out = run_on_ranks(
        _restore_run,
        world_size=1,
        kwargs=dict(restore_from=str(path), ckpt_dir=str(tmp_path)),
        timeout_s=TIMEOUT,
    )[0]
    assert "cannot read DCP metadata" in out["error"] and "pathlib.Path.touch" in out["error"]
    assert not marker.exists()
    # What torch's own reader would do with the same file: the payload runs.
    with pytest.raises(Exception):  # noqa: B017 - whatever it fails with after running the payload
        dcp.FileSystemReader(str(path)).read_metadata()
    assert marker.exists()


def test_metadata_unpickler_allows_only_metadata_classes(saved):
    import io

    data = (saved[0] / ckpt_paths.DCP_METADATA_FILE).read_bytes()
    assert MetadataUnpickler(io.BytesIO(data)).load().state_dict_metadata
    for evil in (os.system, eval, getattr, torch.load):
        with pytest.raises(pickle.UnpicklingError, match="never holds"):
            MetadataUnpickler(io.BytesIO(pickle.dumps(evil))).load()


def test_legacy_checkpoint_converts_with_explicit_trust(saved, tmp_path):
    path, ref = saved
    legacy = _copy(path, tmp_path / "legacy")
    state = _full_state(legacy)
    state["extra_rank0"] = _legacy_blob(decode_extra(state["extra_rank0"]))
    _rewrite(legacy, state)
    _fix_sizes(legacy, format_version=1)
    with pytest.raises(ValueError, match="trust_pickle"):
        convert_legacy_checkpoint(source=legacy, destination=tmp_path / "new", trust_pickle=False)
    assert convert_main([str(legacy), str(tmp_path / "new")]) == 2  # no --trust-pickle: refused
    assert not (tmp_path / "new").exists()
    assert convert_main(["--trust-pickle", str(legacy), str(tmp_path / "new")]) == 0
    out = run_on_ranks(
        _restore_run,
        world_size=1,
        kwargs=dict(restore_from=str(tmp_path / "new"), ckpt_dir=str(tmp_path)),
        timeout_s=TIMEOUT,
    )[0]
    assert "error" not in out, out
    assert out["step"] == 2 and out["rng"] == ref["rng"] and out["lr"] == ref["lr"]
    for name, p in ref["params"].items():
        assert torch.equal(out["params"][name], p), name


# ---- pickled weights in a model directory ------------------------------------------------------------
def test_pickled_bin_weights_are_refused_and_never_unpickled(tmp_path):
    _assert_payload_is_live(tmp_path)
    marker = tmp_path / "pwned"
    d = tmp_path / "hf"
    d.mkdir()
    torch.save({"model.embed_tokens.weight": Payload(marker)}, d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_pickle_weights"):
        load_pretrained_weights([_model()], d)
    assert not marker.exists()
    # Opted in: still torch's weights-only unpickler, which refuses the payload.
    with pytest.raises(ValueError, match="weights_only=True"):
        load_pretrained_weights([_model()], d, allow_pickle_weights=True)
    assert not marker.exists()


def _load_bin(*, directory: str) -> dict:
    model = _model(seed=321)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    fully_shard(model, mesh=mesh)
    load_pretrained_weights([model], directory, allow_pickle_weights=True)
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def test_opted_in_bin_weights_load_into_sharded_model(tmp_path):
    ref = _model(seed=5)
    (tmp_path / "hf").mkdir()
    torch.save(ref.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    out = run_on_ranks(
        _load_bin, world_size=2, kwargs=dict(directory=str(tmp_path / "hf")), timeout_s=TIMEOUT
    )
    for name, p in ref.named_parameters():
        assert torch.equal(out[0][name], p.detach()), name


def test_model_section_keys():
    from automodel.recipes.config.sections import ModelSection, TokenizerSection, build_section

    section = build_section(ModelSection, {"pretrained_path": "x", "allow_pickle_weights": True})
    assert section.allow_pickle_weights is True and section.trust_remote_code is False
    for key in ("allow_pickle_weights", "trust_remote_code"):
        with pytest.raises(ConfigError, match=f"model.{key}"):
            build_section(ModelSection, {"pretrained_path": "x", key: "yes"})
    with pytest.raises(ConfigError, match="tokenizer.trust_remote_code"):
        build_section(TokenizerSection, {"trust_remote_code": 1})


# ---- remote code in a model / tokenizer directory --------------------------------------------------
_EVIL_MODULE = """
from pathlib import Path
Path({marker!r}).touch()
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizer
class EvilConfig(LlamaConfig):
    model_type = "evil_lm"
class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
class EvilTokenizer(PreTrainedTokenizer):
    pass
"""


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """Keep transformers' copy of imported remote code inside the test's directory."""
    import transformers.dynamic_module_utils as dmu

    cache = tmp_path / "hf_modules"
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(cache))
    return cache


def _evil_model_dir(tmp_path: Path, *, model_type: str) -> tuple[Path, Path]:
    marker = tmp_path / "pwned"
    d = tmp_path / "evil_model"
    d.mkdir()
    (d / "evil.py").write_text(_EVIL_MODULE.format(marker=str(marker)))
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    ).to_dict()
    config.update(
        model_type=model_type,
        auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
    )
    (d / "config.json").write_text(json.dumps(config))
    return d, marker


def _section(path: Path, **kw):
    from automodel.recipes.config.sections import ModelSection

    return ModelSection(pretrained_path=str(path), **kw)


def test_remote_model_code_is_not_run_by_default(tmp_path, modules_cache, capsys):
    from automodel.recipes.model import build_hf_config, build_meta_model

    d, marker = _evil_model_dir(tmp_path, model_type="evil_lm")
    with pytest.raises(ConfigError, match="model.trust_remote_code"):
        build_hf_config(_section(d))
    assert not marker.exists()
    # Positive control: the YAML opts in, the code runs, and rank 0 says so once.
    cfg = build_hf_config(_section(d, trust_remote_code=True))
    assert marker.exists()
    err = capsys.readouterr().err
    assert err.count("model.trust_remote_code: true") == 1 and str(d) in err
    build_hf_config(_section(d, trust_remote_code=True), announce=False)  # the pre-launch check is quiet
    assert "trust_remote_code" not in capsys.readouterr().err
    assert type(build_meta_model(cfg, trust_remote_code=True)).__name__ == "EvilModel"


def test_known_model_type_with_auto_map_uses_transformers_own_code(tmp_path, modules_cache):
    from automodel.recipes.model import build_hf_config, build_meta_model

    d, marker = _evil_model_dir(tmp_path, model_type="llama")
    cfg = build_hf_config(_section(d))
    model = build_meta_model(cfg)
    assert type(model) is LlamaForCausalLM
    assert not marker.exists()


def test_remote_tokenizer_code_is_not_run_by_default(tmp_path, modules_cache):
    from automodel.data.tokenizer import HFTokenizer

    marker = tmp_path / "pwned"
    d = tmp_path / "evil_tok"
    d.mkdir()
    (d / "evil.py").write_text(_EVIL_MODULE.format(marker=str(marker)))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}
        )
    )
    with pytest.raises(ConfigError, match="tokenizer.trust_remote_code"):
        HFTokenizer(str(d))
    assert not marker.exists()


def test_quantized_checkpoint_is_refused_naming_the_method(tmp_path):
    """fp8 / int codes with scales read as plain weights would train on garbage: refused up front."""
    from automodel.recipes.model import build_hf_config

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    config.save_pretrained(tmp_path)
    build_hf_config(_section(tmp_path))  # positive control: the same directory, not quantized
    data = json.loads((tmp_path / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="model.pretrained_path.*quantized checkpoint.*'fp8'.*dequantize"):
        build_hf_config(_section(tmp_path))
