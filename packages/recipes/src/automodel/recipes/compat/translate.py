"""NeMo AutoModel's recipe keys -> this project's, before the sections are parsed.

`translate` takes the loaded YAML mapping and returns the mapping the sections read, plus the
start-up lines for settings honoured differently here. It only renames and resolves: every value
is still checked by its section afterwards. A key AutoModel has that cannot be honoured here is
refused naming it; none is dropped without a line saying so, except the ones listed in
`METADATA` (they configure AutoModel's CI and launchers, not the training).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from automodel.mesh import parse_dtype
from automodel.recipes.compat.aliases import LOSS_KERNEL_KEYS, match
from automodel.recipes.compat.backend import read_backend
from automodel.recipes.errors import ConfigError
from automodel.recipes.hub_cache import resolve_local_or_cached

#: top-level sections about AutoModel's CI, not the run: accepted and not used
METADATA = ("ci",)
#: top-level sections AutoModel's training recipe (train_ft) does not read either: accepted with a line
UNREAD = ("autopipeline", "longalign", "distributed_config")
#: top-level sections that only speed up AutoModel's own kernels: accepted with a line
SPEED_ONLY = {
    "prewarm": "autotunes AutoModel's Mamba SSD Triton kernels before the first step; nothing to warm up "
    "here (kernels tune on first use), the same numbers",
}
#: top-level sections of AutoModel tools that are not part of this project (refused when parsed)
NOT_HERE = {
    "skypilot": "AutoModel's SkyPilot launcher is not part of this project; run `recipes train` on the machine",
    "benchmark": "AutoModel's benchmark recipe is not part of this project; see `recipes plan`",
    "tool_call_eval": "the tool-call evaluator is not part of this project",
}
#: top-level sections of training features this project does not implement: the file loads (so
#: `recipes validate` plans it) and `recipes train` refuses it before launch
NOT_IMPLEMENTED = {
    "quantization": "quantized (QLoRA / bitsandbytes) training is not implemented in this project",
    "qat": "quantization-aware training is not implemented in this project",
    "neftune": "NEFTune embedding noise is not implemented in this project",
    "embedding_row_repair": "repairing near-zero input-embedding rows after loading is not implemented in "
    "this project",
}


@dataclass(frozen=True)
class Translation:
    """`translate`'s result: the mapping the sections read, the start-up lines of what differs
    here, and the settings `recipes train` and `recipes validate` refuse before launch
    (`environment.check_environment`): valid AutoModel settings this project cannot honour on any
    machine, kept out of the parse so the file loads and `recipes validate` shows its plan first."""

    raw: dict
    notes: list[str] = field(default_factory=list)
    refusals: list[ConfigError] = field(default_factory=list)


def translate(raw: dict) -> Translation:
    """AutoModel's keys in `raw` rewritten to this project's (see the module docstring)."""
    out = copy.deepcopy(raw)
    result = Translation(out)
    notes = result.notes
    _top_level(out, notes, result.refusals)
    _model(out, notes, result.refusals)
    _tokenizer(out)
    _peft(out, notes, result.refusals)
    _distributed(out, notes)
    for name in ("dataset", "validation_dataset"):
        _dataset(out, name)
    _dataloaders(out)
    _loss_fn(out)
    _optimizer(out, notes, result.refusals)
    _lr_scheduler(out)
    _packed_sequence(out, notes)
    _step_scheduler(out, notes)
    return result


def _none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.lower() in ("none", "null"))


def _enabled(section: str, data: Any, *, flag: str = "enabled") -> bool:
    if not isinstance(data, dict):
        raise ConfigError(section, data, "must be a mapping")
    value = data.get(flag, True)
    if not isinstance(value, bool):
        raise ConfigError(f"{section}.{flag}", value, "must be true or false")
    return value


def _top_level(out: dict, notes: list[str], refusals: list[ConfigError]) -> None:
    for key in [k for k in out if isinstance(k, str) and k.startswith("_")]:
        del out[key]  # AutoModel's convention: a disabled section, or the holder of a YAML anchor
    for key in METADATA:
        out.pop(key, None)
    for key in UNREAD:
        if key in out:
            out.pop(key)
            notes.append(f"{key}: not read by AutoModel's training recipe either; not used here")
    for key, why in SPEED_ONLY.items():
        if key in out:
            if not isinstance(out.pop(key), dict):
                raise ConfigError(key, "...", "must be a mapping")
            notes.append(f"{key}: {why}")
    for key, why in NOT_HERE.items():
        if key in out:
            raise ConfigError(key, "...", why)
    for key, why in NOT_IMPLEMENTED.items():
        if key in out:
            section = out.pop(key)
            if not (isinstance(section, dict) and section.get("enabled", True) is False):
                refusals.append(ConfigError(key, "...", f"{why}; remove the section"))
    if "recipe" in out:
        recipe = out.pop("recipe")
        target = recipe.get("_target_") if isinstance(recipe, dict) else recipe
        match("recipe", target, key="recipe._target_" if isinstance(recipe, dict) else "recipe")
    if "rng" in out:
        rng = out.pop("rng")
        if not isinstance(rng, dict):
            raise ConfigError("rng", rng, "must be a mapping (AutoModel's StatefulRNG)")
        rng = dict(rng)
        if "_target_" in rng:
            match("rng", rng.pop("_target_"), key="rng._target_")
        if "seed" in rng:
            seed = rng.pop("seed")
            if "seed" in out and out["seed"] != seed:
                raise ConfigError("rng.seed", seed, f"differs from seed={out['seed']}; give one of them")
            out["seed"] = seed
        if rng:
            out["rng"] = rng  # ranked: read by sections.RngSection
    if "compile" in out:
        section = out.pop("compile")
        if _enabled("compile", section):
            _compile(section, out)
    # fp8: AutoModel's keys and defaults are this project's (kernels.sections.FP8Section)
    if "parallelizer" in out:  # AutoModel's MoE parallelizer: expert parallelism is distributed.ep_size here
        par = out.pop("parallelizer")
        if not isinstance(par, dict):
            raise ConfigError("parallelizer", par, "must be a mapping")
        par = dict(par)
        if "_target_" in par and not str(par.pop("_target_")).endswith("moe.parallelizer.parallelize_model"):
            raise ConfigError(
                "parallelizer._target_", "...", "only AutoModel's moe parallelize_model is known"
            )
        if par.pop("activation_checkpointing", False):
            dist = out.setdefault("distributed", {}) or {}
            out["distributed"] = dist
            dist["activation_checkpointing"] = True
        if par:
            key = sorted(par)[0]
            raise ConfigError(f"parallelizer.{key}", par[key], "unknown key")
    if "wandb" in out and not _enabled("wandb", out["wandb"], flag="enable"):
        out.pop("wandb")  # AutoModel's recorded files keep a disabled section; enabled, it logs (trackers/)
    if "nvtx" in out:
        if out.pop("nvtx") is not False:
            raise ConfigError("nvtx", True, "NVTX ranges are not emitted by this project; set it to false")


def _compile(section: dict, out: dict) -> None:
    """``compile.enabled: true`` -> per-layer torch.compile (``distributed.enable_compile``)."""
    for key, default in (("mode", "default"), ("fullgraph", False), ("backend", None)):
        if section.get(key, default) not in (default, None if key == "backend" else default):
            raise ConfigError(f"compile.{key}", section[key], f"only {default!r} is supported here")
    unknown = set(section) - {"enabled", "mode", "fullgraph", "dynamic", "backend"}
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(f"compile.{key}", section[key], "unknown key")
    dist = out.setdefault("distributed", {}) or {}
    out["distributed"] = dist
    dist["enable_compile"] = True


# ---- model ----------------------------------------------------------------------------------
#: AutoModel's multi-token-prediction keys (meaningful only with num_nextn_predict_layers > 0)
MTP_KEYS = ("num_nextn_predict_layers", "mtp_loss_scaling_factor", "mtp_use_repeated_layer")
#: ``model`` keys AutoModel's from_pretrained passes on as config fields (``model.config_overrides``
#: here, each checked against the model's config class when it is built)
CONFIG_KWARGS = ("kda_mode",)


def _model(out: dict, notes: list[str], refusals: list[ConfigError]) -> None:
    model = out.get("model")
    if not isinstance(model, dict):
        return
    if "backend" in model:
        line = read_backend(model.pop("backend"), refusals=refusals)
        if line:
            notes.append(line)
    mtp = {k: model.pop(k) for k in list(model) if k in MTP_KEYS}
    if mtp.get("num_nextn_predict_layers", 0) != 0:
        refusals.append(
            ConfigError(
                "model.num_nextn_predict_layers",
                mtp["num_nextn_predict_layers"],
                "multi-token prediction is not implemented in this project; set it to 0",
            )
        )
    if model.pop("output_hidden_states", False) not in (True, False):
        raise ConfigError("model.output_hidden_states", "...", "must be true or false")
    load_base = model.pop("load_base_model", True)
    if not isinstance(load_base, bool):
        raise ConfigError("model.load_base_model", load_base, "must be true or false")
    if "use_liger_kernel" in model:
        _use_liger_kernel(out, model.pop("use_liger_kernel"))
    for key, same in (("force_hf", True), ("use_sdpa_patching", False)):
        if key in model:
            if model[key] is not same:
                raise ConfigError(
                    f"model.{key}", model[key], f"only {same} is supported here (the transformers model runs)"
                )
            del model[key]
    how = None
    if "_target_" in model:
        how = match("model", model.pop("_target_"), key="model._target_")
        if how == "from_pretrained" and "pretrained_model_name_or_path" not in model:
            raise ConfigError("model.pretrained_model_name_or_path", None, "is required by from_pretrained")
        if how == "from_pretrained" and isinstance(model.get("config"), dict):
            _pretrained_config_overrides(model)
        if how == "from_pretrained" and not load_base:  # the architecture only, randomly initialized
            source = model.pop("pretrained_model_name_or_path")
            model["config"] = _config_dict(
                {"_target_": "AutoConfig.from_pretrained", "pretrained_model_name_or_path": source}
            )
        if how == "from_config":
            model["config"] = _config_dict(model.get("config"))
        if how == "gpt2":
            fields = {
                k: model.pop(k)
                for k in list(model)
                if k not in ("torch_dtype", "dtype", "attn_implementation")
            }
            model["config"] = {"model_type": "gpt2", **fields}
    for key in CONFIG_KWARGS:  # AutoModel's from_pretrained hands these to the model's config
        if key in model:
            config = model.get("config")
            target = config if how == "from_config" and isinstance(config, dict) else None
            if target is None:
                target = model.setdefault("config_overrides", {})
            target[key] = model.pop(key)
    if "torch_dtype" in model:
        if "dtype" in model:
            raise ConfigError(
                "model.torch_dtype", model["torch_dtype"], "is AutoModel's name of model.dtype; give one"
            )
        value = model.pop("torch_dtype")
        model["dtype"] = _auto_dtype(model) if value == "auto" else value


def _use_liger_kernel(out: dict, value: Any) -> None:
    """``model.use_liger_kernel: true`` -> ``kernels.liger: auto``: AutoModel applies Liger where it
    can and falls back otherwise, so here too, with a start-up line when not applied. false, like
    the key absent (AutoModel's default is true), leaves the kernels off without a line."""
    if not isinstance(value, bool):
        raise ConfigError("model.use_liger_kernel", value, "must be true or false")
    if not value:
        return
    kernels = out.get("kernels")
    if kernels is None:
        kernels = out["kernels"] = {}
    if isinstance(kernels, dict):
        if "liger" in kernels:
            raise ConfigError(
                "model.use_liger_kernel",
                True,
                "is AutoModel's name of kernels.liger (auto); give one of them",
            )
        kernels["liger"] = "auto"


def _pretrained_config_overrides(model: dict) -> None:
    """``from_pretrained`` with ``config: {k: v}`` (optionally ``_target_: AutoConfig.from_pretrained`` of
    the same checkpoint): the checkpoint's own config with those fields set (``model.config_overrides``)."""
    config = dict(model.pop("config"))
    target = config.pop("_target_", None)
    if target is not None and not (isinstance(target, str) and target.endswith(".from_pretrained")):
        raise ConfigError(
            "model.config._target_",
            target,
            "next to model.pretrained_model_name_or_path only AutoConfig.from_pretrained of the same "
            "checkpoint is read (its fields then override that checkpoint's config)",
        )
    source = config.pop("pretrained_model_name_or_path", None)
    if source not in (None, model.get("pretrained_model_name_or_path")):
        raise ConfigError(
            "model.config.pretrained_model_name_or_path",
            source,
            f"must name the model's checkpoint {model.get('pretrained_model_name_or_path')!r}: "
            "its weights are read with their own config",
        )
    trust = config.pop("trust_remote_code", None)
    if trust is not None and trust != model.get("trust_remote_code", False):
        raise ConfigError(
            "model.config.trust_remote_code", trust, "must equal model.trust_remote_code (one setting here)"
        )
    attn = config.pop("_attn_implementation", None)
    if attn is not None:
        if model.get("attn_implementation", attn) != attn:
            raise ConfigError(
                "model.config._attn_implementation",
                attn,
                f"differs from model.attn_implementation={model['attn_implementation']!r}; give one",
            )
        model["attn_implementation"] = attn
    if config:
        model["config_overrides"] = config


def _config_dict(config: Any) -> dict:
    """``model.config`` of a from_config model: a local config.json (+ overrides) or a config class."""
    if not isinstance(config, dict):
        raise ConfigError("model.config", config, "from_config needs a model.config mapping")
    config = dict(config)
    target = config.pop("_target_", None)
    if target is None:
        return config
    if not isinstance(target, str):
        raise ConfigError("model.config._target_", target, "must be a dotted class path")
    source = config.pop("pretrained_model_name_or_path", None)
    config.pop("trust_remote_code", None)  # a config.json read here runs no code
    if target.endswith(".from_pretrained"):
        if source is None:
            raise ConfigError("model.config.pretrained_model_name_or_path", None, f"is required by {target}")

        path = resolve_local_or_cached(
            source, key="model.config.pretrained_model_name_or_path", required_file="config.json"
        )
        base = json.loads((Path(path) / "config.json").read_text())
        return {**base, **config}
    try:
        cls = getattr(transformers, target.rsplit(".", 1)[-1])
    except (ImportError, AttributeError):
        raise ConfigError("model.config._target_", target, "is not a transformers config class") from None
    return {"model_type": cls.model_type, **config}


def _auto_dtype(model: dict) -> str:
    """``torch_dtype: auto``: the dtype the checkpoint's config.json names (float32 if none), as transformers."""
    source = model.get("pretrained_model_name_or_path") or model.get("pretrained_path")
    if not isinstance(source, str):
        return "float32"

    path = resolve_local_or_cached(
        source, key="model.pretrained_model_name_or_path", required_file="config.json"
    )
    data = json.loads((Path(path) / "config.json").read_text())
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    return str(
        data.get("dtype")
        or data.get("torch_dtype")
        or text.get("dtype")
        or text.get("torch_dtype")
        or "float32"
    )


def _tokenizer(out: dict) -> None:
    tok = out.get("tokenizer")
    if isinstance(tok, dict) and "_target_" in tok:
        match("tokenizer", tok.pop("_target_"), key="tokenizer._target_")


def _peft(out: dict, notes: list[str], refusals: list[ConfigError]) -> None:
    peft = out.get("peft")
    if not isinstance(peft, dict):
        return
    if "_target_" in peft:
        match("peft", peft.pop("_target_"), key="peft._target_")
    scaling = peft.pop("moe_rank_scaling", False)
    if not isinstance(scaling, bool):
        raise ConfigError("peft.moe_rank_scaling", scaling, "must be true or false")
    if scaling:  # AutoModel: the experts' LoRA rank is dim // experts per token
        refusals.append(
            ConfigError(
                "peft.moe_rank_scaling",
                True,
                "LoRA on MoE experts is not implemented here (transformers keeps expert weights as stacked "
                "3-D parameters), so there is no expert rank to scale; set it to false and exclude the experts",
            )
        )
    kernels = []
    for key in ("use_triton", "use_memory_efficient_lora"):
        if key in peft:
            value = peft.pop(key)
            if not isinstance(value, bool):
                raise ConfigError(f"peft.{key}", value, "must be true or false")
            if value:
                kernels.append(key)
    if kernels:
        notes.append(
            f"peft.{' / peft.'.join(kernels)}: LoRA runs as plain torch matmuls here (same math, no Triton kernel)"
        )


# ---- distributed ----------------------------------------------------------------------------
def _distributed(out: dict, notes: list[str]) -> None:
    dist = out.get("distributed")
    if not isinstance(dist, dict):
        return
    if "_target_" in dist:
        strategy = match("distributed", dist.pop("_target_"), key="distributed._target_")
        if dist.get("strategy", strategy) != strategy:
            raise ConfigError(
                "distributed.strategy", dist["strategy"], f"contradicts distributed._target_ ({strategy})"
            )
        dist["strategy"] = strategy
    if "ep_size" in dist and _none(dist["ep_size"]):
        dist["ep_size"] = 1  # AutoModel: no expert parallelism
    pipeline = dist.get("pipeline")
    if isinstance(pipeline, dict):
        for key in ("patch_inner_model", "patch_causal_lm_model"):
            if key in pipeline:
                if pipeline[key] is not False:
                    raise ConfigError(
                        f"distributed.pipeline.{key}",
                        pipeline[key],
                        "only false is supported: every stage runs the model's own forward",
                    )
                del pipeline[key]
    if "reshard_after_forward" in dist:
        value = dist.pop("reshard_after_forward")
        if not isinstance(value, bool):
            raise ConfigError("distributed.reshard_after_forward", value, "must be true or false")
        notes.append(
            f"distributed.reshard_after_forward={str(value).lower()}: here FSDP2 reshards every layer but the "
            "last after forward (none under pp); memory only, the same numbers"
        )
    backend = dist.get("backend")
    if backend is not None:  # AutoModel's FSDP2Manager(backend=...): the process-group backend
        env = out.setdefault("dist_env", {}) or {}
        out["dist_env"] = env
        if env.get("backend") is None:
            env["backend"] = backend
        elif env["backend"] != backend:
            raise ConfigError(
                "distributed.backend",
                backend,
                f"contradicts dist_env.backend={env['backend']}; give one of them",
            )


# ---- data -----------------------------------------------------------------------------------
def _dataset(out: dict, name: str) -> None:
    data = out.get(name)
    if _none(data):
        out.pop(name, None)
        return
    if not isinstance(data, dict):
        return
    if data.get("mask_reasoning_content", False) is False:
        data.pop("mask_reasoning_content", None)  # AutoModel's default: reasoning text is trained on, as here
    tok = data.get("tokenizer")
    if isinstance(tok, dict) and "_target_" in tok:
        data["tokenizer"] = {k: v for k, v in tok.items() if k != "_target_"}
        match("tokenizer", tok["_target_"], key=f"{name}.tokenizer._target_")


def _dataloaders(out: dict) -> None:
    for name in ("dataloader", "validation_dataloader"):
        data = out.get(name)
        if _none(data):
            out.pop(name, None)
            continue
        if not isinstance(data, dict):
            raise ConfigError(name, data, "must be a mapping")
        data = dict(data)
        if "_target_" in data:
            match("dataloader", data.pop("_target_"), key=f"{name}._target_")
        if "collate_fn" in data:
            collate = data.pop("collate_fn")
            target = collate.get("_target_") if isinstance(collate, dict) else collate
            if collate is not None:
                data["collate"] = match("collate_fn", target, key=f"{name}.collate_fn")
                extra = (
                    {k: v for k, v in collate.items() if k != "_target_"} if isinstance(collate, dict) else {}
                )
                if "pad_seq_len_divisible" in extra:
                    data["pad_seq_len_divisible"] = extra.pop("pad_seq_len_divisible")
                if extra:
                    key = sorted(extra)[0]
                    raise ConfigError(f"{name}.collate_fn.{key}", extra[key], "unknown collate argument")
        out[name] = data


def _loss_fn(out: dict) -> None:
    loss = out.get("loss_fn")
    if not isinstance(loss, dict) or "_target_" not in loss:
        return
    target = loss["_target_"]
    if isinstance(target, str) and target.startswith("nemo_automodel."):
        kernel = {k: v for k, v in loss.items() if k != "_target_"}
        for key in kernel:
            if key not in LOSS_KERNEL_KEYS:
                raise ConfigError(f"loss_fn.{key}", kernel[key], "unknown argument of the AutoModel loss")
        if kernel.get("ignore_index", -100) != -100 or kernel.get("reduction", "sum") not in ("sum", "mean"):
            key = "ignore_index" if "ignore_index" in kernel else "reduction"
            raise ConfigError(
                f"loss_fn.{key}",
                kernel[key],
                "is not supported (labels -100 are ignored; the loss is per token)",
            )
        out["loss_fn"] = match("loss_fn", target, key="loss_fn._target_")


#: AutoModel's names of the schedule's keys (its ``lr_decay_steps`` counts the warm-up, this
#: project's ``decay_steps`` does not: it is refused by the section as an unknown key)
_LR_NAMES = {"lr_warmup_steps": "warmup_steps", "lr_decay_style": "decay_style"}


def _lr_scheduler(out: dict) -> None:
    sched = out.get("lr_scheduler")
    if not isinstance(sched, dict):
        return
    for old, new in _LR_NAMES.items():
        if old in sched:
            if new in sched:
                raise ConfigError(
                    f"lr_scheduler.{old}", sched[old], f"is AutoModel's name of lr_scheduler.{new}; give one"
                )
            sched[new] = sched.pop(old)


def _packed_sequence(out: dict, notes: list[str]) -> None:
    packed = out.get("packed_sequence")
    if not isinstance(packed, dict):
        return
    steps, dist = out.get("step_scheduler"), out.get("distributed") or {}
    size, local = packed.get("packed_sequence_size", 0), (steps or {}).get("local_batch_size", 1)
    if (
        isinstance(size, int)
        and size > 0
        and isinstance(local, int)
        and local > 1
        and dist.get("pp_size", 1) == 1
    ):
        steps["local_batch_size"] = 1  # the loss is per global batch: the same numbers, in smaller steps
        notes.append(
            f"step_scheduler.local_batch_size={local}: packed rows go one per micro-batch here "
            "(same global batch and loss, more accumulation steps)"
        )
    if packed.get("packing_strategy", "thd") != "thd":
        raise ConfigError(
            "packed_sequence.packing_strategy",
            packed["packing_strategy"],
            "only thd (documents kept apart) is supported",
        )
    packed.pop("packing_strategy", None)
    if packed.get("split_across_pack", False) is not False:
        raise ConfigError(
            "packed_sequence.split_across_pack",
            packed["split_across_pack"],
            "only false: an example is never split across rows",
        )
    packed.pop("split_across_pack", None)
    if "num_proc" in packed:
        value = packed.pop("num_proc")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError("packed_sequence.num_proc", value, "must be an int >= 1")


def _step_scheduler(out: dict, notes: list[str]) -> None:
    steps = out.get("step_scheduler")
    if not isinstance(steps, dict):
        return
    steps.pop("log_remote_every_steps", None)  # wandb / mlflow get every step's record here (trackers/)
    if "loss_average_window_steps" in steps:
        window = steps.pop("loss_average_window_steps")
        notes.append(
            f"step_scheduler.loss_average_window_steps={window}: metrics.jsonl reports each step's loss "
            "(average it when plotting)"
        )
    if steps.get("val_every_steps") is not None and out.get("validation_dataset") is None:
        notes.append(
            f"step_scheduler.val_every_steps={steps.pop('val_every_steps')} has no effect: no validation_dataset"
        )


#: TE FusedAdam options and the value torch's Adam / AdamW always has
_TE_ADAM_FIXED = {"bias_correction": True, "store_param_remainders": None, "capturable": False}


def _computes_in(out: dict, dtype: torch.dtype) -> bool:
    """Whether the file's ``distributed.mp_policy`` computes in `dtype` (its ``param_dtype``)."""
    dist = out.get("distributed")
    policy = dist.get("mp_policy") if isinstance(dist, dict) else None
    if not isinstance(policy, dict) or policy.get("param_dtype") is None:
        return False
    return parse_dtype(policy["param_dtype"], key="distributed.mp_policy.param_dtype") == dtype


def _optimizer(out: dict, notes: list[str], refusals: list[ConfigError]) -> None:
    """transformer-engine's FusedAdam -> torch.optim.AdamW (adam_w_mode) or Adam, where the same math
    holds: its fp32 master weights and moments are the fp32 parameters and state of a float32 model."""
    opt = out.get("optimizer")
    if not isinstance(opt, dict) or not str(opt.get("_target_", "")).endswith("fused_adam.FusedAdam"):
        return
    adamw = opt.pop("adam_w_mode", True)
    opt["_target_"] = "torch.optim.AdamW" if adamw else "torch.optim.Adam"
    for key, value in _TE_ADAM_FIXED.items():
        if key in opt:
            given = opt.pop(key)
            if value is not None and given != value:
                raise ConfigError(f"optimizer.{key}", given, f"only {value} is supported (torch's Adam)")
    masters = opt.pop("master_weights", False)
    opt.pop("master_weight_bits", None)

    model = out.get("model") or {}
    dtype = parse_dtype(model.get("dtype", "float32"), key="model.torch_dtype")
    if masters and dtype != torch.float32 and _computes_in(out, dtype):
        # FusedAdam's fp32 master weights of low-precision parameters that FSDP2 computes in that
        # dtype anyway: the same update as fp32 parameters (the masters) under that mp_policy
        model["dtype"] = "float32"
        notes.append(
            f"optimizer.master_weights: true with model.torch_dtype {dtype}: the model is kept in float32 (the "
            f"fp32 master weights) and distributed.mp_policy computes in {dtype} (the same update)"
        )
        dtype = torch.float32
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if key in opt:
            value = opt.pop(key)
            if parse_dtype(value, key=f"optimizer.{key}") != dtype:
                refusals.append(
                    ConfigError(
                        f"optimizer.{key}",
                        value,
                        f"differs from the parameters' dtype ({dtype}); not supported",
                    )
                )
    if masters and str(dtype) != "torch.float32":
        refusals.append(
            ConfigError(
                "optimizer.master_weights",
                True,
                f"fp32 master weights of {dtype} parameters are not implemented; train a float32 model "
                "(model.torch_dtype: float32) with distributed.mp_policy for bf16 compute",
            )
        )
    notes.append(f"optimizer: transformer-engine's FusedAdam runs as {opt['_target_']} (the same update)")
