"""NeMo AutoModel 0.7's initial LoRA adapter, exactly as its training run of the same file starts from it.

Run with AutoModel's own python (never this repository's), under torchrun, with the file and the
overrides its training run gets:

    python -m torch.distributed.run --standalone --nproc-per-node N _automodel_initial_adapter.py OUT FILE --key=value ...

It does what ``nemo_automodel.cli.app`` does in a torchrun worker up to the first step (read the
file, apply the overrides, build the recipe class the file names, ``setup()``), then gathers every
``lora_A``/``lora_B`` weight to full size and writes OUT in Hugging Face PEFT format
(``adapter_model.safetensors`` with ``base_model.model.<fqn>`` keys, ``adapter_config.json`` with the
file's ``r`` and ``lora_alpha``), which ``recipes train`` starts from with ``peft.initial_adapter``.
No step is trained. Why this is needed (AutoModel draws each rank's shard of A from that rank's
own stream, after the base weights' random init): docs/performance.md, "NeMo AutoModel 0.7 on CPU".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# AutoModel's venv only (this repository's type check does not install it)
from nemo_automodel.cli.utils import load_yaml, resolve_recipe_name  # pyright: ignore[reportMissingImports]
from nemo_automodel.components.config._arg_parser import (  # pyright: ignore[reportMissingImports]
    parse_args_and_load_config,
)
from nemo_automodel.components.launcher.interactive import (  # pyright: ignore[reportMissingImports]
    resolve_recipe_cls,
)
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

PREFIX = "base_model.model."
WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def bare_name(fqn: str) -> str:
    """The parameter's name in the bare model (wrapper atoms dropped)."""
    return ".".join(a for a in fqn.split(".") if a not in WRAPPERS)


def initial_adapter(out: Path, file: Path, overrides: list[str]) -> None:
    config = load_yaml(file.resolve())
    section = config.get("recipe")
    target = section["_target_"] if isinstance(section, dict) else section
    cfg = parse_args_and_load_config(str(file.resolve()), argv=overrides)
    recipe = resolve_recipe_cls(resolve_recipe_name(target))(cfg)
    recipe.setup()
    tensors: dict[str, torch.Tensor] = {}
    for part in recipe.model_parts:
        for name, p in part.named_parameters():  # the same order on every rank: full_tensor is collective
            if ".lora_A." in name or ".lora_B." in name:
                full = p.full_tensor() if isinstance(p, DTensor) else p
                tensors[PREFIX + bare_name(name)] = (
                    full.detach().to("cpu", torch.float32).contiguous().clone()
                )
    if not tensors:
        raise SystemExit(f"{file}: the model has no lora_A / lora_B weights (no peft section?)")
    if dist.get_rank() == 0:
        peft = recipe.peft_config
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        leaves = sorted({k.rsplit(".", 3)[-3] for k in tensors})  # q_proj of <fqn>.q_proj.lora_A.weight
        (out / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "task_type": "CAUSAL_LM",
                    "base_model_name_or_path": str(cfg.get("model.pretrained_model_name_or_path", "")),
                    "r": peft.dim,
                    "lora_alpha": peft.alpha,
                    "lora_dropout": peft.dropout,
                    "target_modules": leaves,
                    "use_dora": bool(peft.use_dora),
                    "init_lora_weights": peft.lora_A_init,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {len(tensors)} adapter tensors to {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    initial_adapter(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
