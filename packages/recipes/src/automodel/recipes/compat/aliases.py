"""The alias table: NeMo AutoModel's ``_target_`` class paths and what each means here.

AutoModel recipes name Python classes (``_target_``) that do not exist in this project. Each one
they use is listed here with this project's equivalent; a ``_target_`` not listed is refused,
naming the key. Matching is on the whole dotted path, or its last one or two names (so
``nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained`` and the class re-exported from a
sub-module both match).

| section | AutoModel ``_target_`` | here |
|---|---|---|
| ``recipe`` | ``TrainFinetuneRecipeForNextTokenPrediction`` | the one training recipe (`recipes train`) |
| ``model`` | ``NeMoAutoModelForCausalLM.from_pretrained``, ``AutoModelForCausalLM.from_pretrained`` | ``model.pretrained_model_name_or_path`` |
| ``model`` | ``NeMoAutoModelForCausalLM.from_config``, ``AutoModelForCausalLM.from_config`` | ``model.config`` (random init) |
| ``model`` | ``components.models.gpt2.build_gpt2_model`` | ``model.config`` of ``model_type: gpt2`` |
| ``model.config`` | ``AutoConfig.from_pretrained`` or a model's ``*Config.from_pretrained`` | that directory's ``config.json`` (+ the other keys) |
| ``model.config`` | a transformers ``*Config`` class | its ``model_type`` + the other keys |
| ``model.backend`` | ``BackendConfig`` | kernel choices: see `compat.backend` |
| ``tokenizer``, ``dataset.tokenizer`` | ``NeMoAutoTokenizer.from_pretrained``, ``AutoTokenizer.from_pretrained`` | ``tokenizer.pretrained_model_name_or_path`` |
| ``peft`` | ``components._peft.lora.PeftConfig`` | the ``peft:`` section (LoRA) |
| ``distributed`` | ``FSDP2Manager`` / ``MegatronFSDPManager`` / ``DDPManager`` | ``distributed.strategy`` fsdp2 / megatron_fsdp / ddp |
| ``dataset`` | ``make_squad_dataset``, ``HellaSwag``, ``ColumnMappedTextInstructionDataset``, ``ChatDataset``, ``MegatronPretraining``, ``NanogptDataset`` | the dataset kinds ``squad``, ``hellaswag``, ``instruction``, ``chat``, ``megatron``, ``nanogpt`` (`data.kinds`) |
| ``dataloader``, ``validation_dataloader`` | ``StatefulDataLoader``, ``torch.utils.data.DataLoader`` | the ``dataloader:`` section (`sections.DataloaderSection`) |
| ``*dataloader.collate_fn`` | ``default_collater``, ``torch.utils.data.default_collate`` | rows padded to one length (padding carries no loss) |
| ``*dataloader.collate_fn`` | ``packed_sequence_thd_collater`` | packed rows (``packed_sequence``); positions restart per document |
| ``loss_fn`` | ``MaskedCrossEntropy``, ``FusedLinearCrossEntropy``, ``ChunkedCrossEntropy``, ``TEParallelCrossEntropy`` | `loss.masked_cross_entropy_sum` (the same loss; no fused or chunked kernel) |
| ``rng`` | ``StatefulRNG`` | ``seed`` (+ ``ranked``) |
| ``optimizer`` | any importable ``torch.optim.Optimizer`` (``torch.optim.Adam``, ``AdamW``) | itself |
"""

from __future__ import annotations

from typing import Any

from automodel.recipes.errors import ConfigError

RECIPES = ("TrainFinetuneRecipeForNextTokenPrediction",)

#: section -> {AutoModel target name: meaning here}
TARGETS: dict[str, dict[str, str]] = {
    "model": {
        "NeMoAutoModelForCausalLM.from_pretrained": "from_pretrained",
        "AutoModelForCausalLM.from_pretrained": "from_pretrained",
        "NeMoAutoModelForCausalLM.from_config": "from_config",
        "AutoModelForCausalLM.from_config": "from_config",
        "gpt2.build_gpt2_model": "gpt2",
    },
    "tokenizer": {
        "NeMoAutoTokenizer.from_pretrained": "tokenizer",
        "AutoTokenizer.from_pretrained": "tokenizer",
        "auto_tokenizer.NeMoAutoTokenizer.from_pretrained": "tokenizer",
    },
    "peft": {"lora.PeftConfig": "lora", "PeftConfig": "lora"},
    "distributed": {
        "FSDP2Manager": "fsdp2",
        "fsdp2.FSDP2Manager": "fsdp2",
        "MegatronFSDPManager": "megatron_fsdp",
        "DDPManager": "ddp",
    },
    "dataloader": {
        "StatefulDataLoader": "loader",
        "stateful_dataloader.StatefulDataLoader": "loader",
        "data.DataLoader": "loader",
    },
    "collate_fn": {
        "default_collater": "pad",
        "utils.default_collater": "pad",
        "data.default_collate": "pad",
        "packed_sequence_thd_collater": "packed",
        "utils.packed_sequence_thd_collater": "packed",
    },
    "loss_fn": dict.fromkeys(
        (
            "MaskedCrossEntropy",
            "masked_ce.MaskedCrossEntropy",
            "FusedLinearCrossEntropy",
            "linear_ce.FusedLinearCrossEntropy",
            "ChunkedCrossEntropy",
            "chunked_ce.ChunkedCrossEntropy",
            "TEParallelCrossEntropy",
            "te_parallel_ce.TEParallelCrossEntropy",
        ),
        "automodel.recipes.loss.masked_cross_entropy_sum",
    ),
    "rng": {"StatefulRNG": "rng", "rng.StatefulRNG": "rng"},
    "recipe": {f"train_ft.{r}": r for r in RECIPES} | {r: r for r in RECIPES},
}

#: ``loss_fn`` keys of the fused / chunked losses: kernel settings of the same loss.
LOSS_KERNEL_KEYS = ("chunk_len", "compile", "reduction", "ignore_index")


def match(section: str, target: Any, *, key: str) -> str:
    """What `target` (an AutoModel ``_target_``) means here; `ConfigError` naming `key` if unknown."""
    table = TARGETS[section]
    if isinstance(target, str):
        parts = target.split(".")
        for n in (2, 1):
            name = ".".join(parts[-n:])
            if name in table:
                return table[name]
    known = ", ".join(sorted({k.rsplit(".", 1)[-1] if "." in k and k[0].isupper() else k for k in table}))
    raise ConfigError(key, target, f"is not an AutoModel class this project maps (known: {known})")


def is_automodel_target(target: Any) -> bool:
    """Whether a ``_target_`` names NeMo AutoModel (or a class its recipes use)."""
    return isinstance(target, str) and (
        target.startswith("nemo_automodel.") or target.startswith("torchdata.")
    )
