"""`recipes generate`: text from a consolidated checkpoint or a LoRA adapter directory.

The model is loaded by transformers (``AutoModelForCausalLM.from_pretrained``, safetensors only,
no remote code) and decoded by its ``generate`` (greedy, or sampling with ``--do-sample``). The
tokenizer is the directory's own; a directory without tokenizer files was trained with the
byte-level tokenizer. A prompt is wrapped in the tokenizer's chat template when it has one (one
user turn plus the generation prompt), else formatted like the SFT data's plain prompts
(``format_plain_prompt``); ``raw`` sends it as is. An adapter directory (``adapter_config.json``)
is applied to its base model (``base_model_name_or_path``, a local directory or a cached Hub id)
with ``peft``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from automodel.data.hub_cache import resolve_local_or_cached
from automodel.data.sft import format_plain_prompt
from automodel.data.tokenizer import ByteTokenizer, HFTokenizer, bos_prefix, has_tokenizer_files
from automodel.recipes.errors import ConfigError


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str


def _load_model(directory: Path) -> tuple[Any, Path]:
    """(model in eval mode, the directory whose tokenizer to use)."""

    def load(path: Path, key: str) -> Any:
        if not any(path.glob("*.safetensors")):
            raise ConfigError(
                key, str(path), "holds no *.safetensors weights (pickled weights are not loaded)"
            )
        return AutoModelForCausalLM.from_pretrained(
            str(path),
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            dtype=torch.float32,
        )

    adapter_cfg = directory / "adapter_config.json"
    if not adapter_cfg.is_file():
        if not (directory / "config.json").is_file():
            raise ConfigError(
                "checkpoint",
                str(directory),
                "is not a model directory (no config.json) or adapter (no adapter_config.json)",
            )
        return load(directory, "checkpoint").eval(), directory
    try:
        # lazy: optional dependency (peft, not a dependency of automodel-recipes)
        import peft
    except ImportError:
        raise ConfigError(
            "checkpoint",
            str(directory),
            "is a LoRA adapter directory; loading it needs the peft package (pip install peft)",
        ) from None
    base = json.loads(adapter_cfg.read_text()).get("base_model_name_or_path")
    if not base:
        raise ConfigError(
            "checkpoint", str(directory), "adapter_config.json names no base_model_name_or_path"
        )
    base_dir = resolve_local_or_cached(
        base, key="adapter_config.json base_model_name_or_path", required_file="config.json"
    )
    model = peft.PeftModel.from_pretrained(load(base_dir, "base_model_name_or_path"), str(directory))

    return model.eval(), directory if has_tokenizer_files(directory) else base_dir


def _tokenizer(directory: Path) -> Any:
    if has_tokenizer_files(directory):
        return HFTokenizer(str(directory))
    return ByteTokenizer()


def prompt_ids(tokenizer: Any, prompt: str, *, raw: bool = False) -> list[int]:
    """Token ids the model continues: chat template (user turn + generation prompt), else the
    plain SFT prompt format; `raw` encodes `prompt` as it is."""
    if raw:
        return tokenizer.encode(prompt)
    if tokenizer.chat_template is not None:
        text = tokenizer.hf.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.hf(text, add_special_tokens=False)["input_ids"])
    return bos_prefix(tokenizer) + tokenizer.encode(format_plain_prompt(context=None, question=prompt))


def generate(
    *,
    checkpoint: str,
    prompt: str,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    raw: bool = False,
) -> Generation:
    """Continue `prompt` with the model in `checkpoint` (see the module docstring)."""
    directory = Path(checkpoint)
    if not directory.is_dir():
        raise ConfigError("checkpoint", checkpoint, "is not a directory")
    if max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", max_new_tokens, "must be >= 1")
    if do_sample and temperature <= 0:
        raise ConfigError("--temperature", temperature, "must be > 0 with --do-sample")
    model, tok_dir = _load_model(directory)
    tokenizer = _tokenizer(tok_dir)
    ids = prompt_ids(tokenizer, prompt, raw=raw)
    if not ids:
        raise ConfigError("--prompt", prompt, "is empty after tokenization")
    torch.manual_seed(seed)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_p": top_p} if do_sample else {"do_sample": False}
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            top_k=None,
            **sampling,
        )
    new = out[0, len(ids) :].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    if tokenizer.hf is not None:
        text = tokenizer.hf.decode(new, skip_special_tokens=True)
    else:
        text = tokenizer.decode(new)
    return Generation(prompt_ids=ids, new_ids=new, text=text)
