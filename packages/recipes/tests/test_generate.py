"""`recipes generate` on a consolidated directory (byte tokenizer / HF tokenizer with a chat
template) and on a LoRA adapter directory equals transformers' own generate on the same ids."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from automodel.recipes.cli import run_cli
from automodel.recipes.errors import ConfigError
from automodel.recipes.generate import generate

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import TINY  # noqa: E402
from _sft_helpers import save_chat_tokenizer  # noqa: E402


def _save_model(directory: Path, seed: int = 5) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = dict(TINY["model"]["config"])
    config = AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def _greedy(model, ids: list[int], n: int, eos: int) -> list[int]:
    """Greedy decoding by hand (argmax of the last logits), stopping at EOS."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=torch.tensor([out]), use_cache=False).logits[0, -1].argmax())
            if nxt == eos:
                break
            out.append(nxt)
    return out[len(ids) :]


def test_generate_byte_tokenizer_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoModelForCausalLM

    _save_model(tmp_path / "ckpt")  # no tokenizer files: a byte-level checkpoint, like the quickstart's
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    prompt_ids = list(b"textwrap.dedent(text)\n")  # the SFT plain prompt format
    expected = _greedy(model, prompt_ids, 12, eos=0)
    out = generate(checkpoint=str(tmp_path / "ckpt"), prompt="textwrap.dedent(text)", max_new_tokens=12)
    assert out.prompt_ids == prompt_ids and out.new_ids == expected
    assert (
        run_cli(
            [
                "generate",
                str(tmp_path / "ckpt"),
                "--prompt",
                "textwrap.dedent(text)",
                "--max-new-tokens",
                "12",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.rstrip("\n") == bytes(i for i in expected if 0 < i < 256).decode(
        errors="replace"
    )
    raw = generate(checkpoint=str(tmp_path / "ckpt"), prompt="abc", max_new_tokens=3, raw=True)
    assert raw.prompt_ids == list(b"abc")
    a = generate(
        checkpoint=str(tmp_path / "ckpt"),
        prompt="x",
        max_new_tokens=8,
        do_sample=True,
        temperature=0.8,
        seed=1,
    )
    b = generate(
        checkpoint=str(tmp_path / "ckpt"),
        prompt="x",
        max_new_tokens=8,
        do_sample=True,
        temperature=0.8,
        seed=1,
    )
    assert a.new_ids == b.new_ids  # seeded sampling repeats


def test_generate_uses_chat_template(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _save_model(tmp_path / "ckpt")
    vocab = save_chat_tokenizer(tmp_path / "ckpt")
    out = generate(checkpoint=str(tmp_path / "ckpt"), prompt="say hi", max_new_tokens=6)
    assert out.prompt_ids == [vocab[w] for w in "<|user|> say hi <|end|> <|assistant|>".split()]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert out.new_ids == _greedy(model, out.prompt_ids, 6, eos=vocab["</s>"])
    tok = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert out.text == tok.decode(out.new_ids, skip_special_tokens=True)


def test_generate_lora_adapter_directory(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    _save_model(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(9)
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            p.data.normal_(std=0.5)  # a trained-looking adapter (B = 0 would change nothing)
    lora.save_pretrained(tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "base")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(cfg))
    merged = lora.merge_and_unload().eval()
    ids = list(b"def f(x):\n")
    out = generate(checkpoint=str(tmp_path / "adapter"), prompt="def f(x):", max_new_tokens=8)
    assert out.prompt_ids == ids and out.new_ids == _greedy(merged, ids, 8, eos=0)
    plain = generate(checkpoint=str(tmp_path / "base"), prompt="def f(x):", max_new_tokens=8)
    assert plain.new_ids != out.new_ids  # the adapter was applied


def test_generate_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty").mkdir()
    assert run_cli(["generate", str(tmp_path / "empty"), "--prompt", "x"]) == 2
    assert "error: checkpoint=" in capsys.readouterr().err
    _save_model(tmp_path / "ckpt")
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(ConfigError, match="safetensors"):
        generate(checkpoint=str(tmp_path / "ckpt"), prompt="x")
    _save_model(tmp_path / "ok")
    with pytest.raises(ConfigError) as e:
        generate(checkpoint=str(tmp_path / "ok"), prompt="x", max_new_tokens=0)
    assert e.value.key == "--max-new-tokens"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/not-cached"}))
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
        generate(checkpoint=str(adapter), prompt="x")
