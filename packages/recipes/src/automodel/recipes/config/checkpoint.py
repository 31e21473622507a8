"""`CheckpointConfig`: the YAML ``checkpoint:`` section, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_SAVE_FORMATS = ("safetensors", "torch_save")
ON_CORRUPT = ("fail", "previous")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how training state is saved, and what a run resumes from.

    ``checkpoint_dir`` None means ``<output_dir>/checkpoints``. ``restore_from`` None resumes
    from the newest complete checkpoint in that directory if there is one (a fresh start
    otherwise); ``"LATEST"`` follows the ``LATEST`` file and fails if there is none; any
    other string is a step directory name (``step_5``) inside ``checkpoint_dir`` or a path.
    """

    enabled: bool = True
    checkpoint_dir: str | None = None
    # true: consolidated/ in every checkpoint; "final" (AutoModel's default): only in the last one
    save_consolidated: bool | str = True
    model_save_format: str = "safetensors"
    keep_last_n: int | None = None
    restore_from: str | None = None
    # AutoModel: dequantize an FP8-quantized base checkpoint when loading it. Quantized checkpoints
    # are refused here (model._refuse_quantized), so on the checkpoints loaded here it changes nothing.
    dequantize_base_checkpoint: bool | None = None
    #: a corrupt checkpoint (checksum mismatch) found at resume: "fail" (stop, naming the previous
    #: complete one) or "previous" (resume from the newest older one that verifies, saying so)
    on_corrupt: str = "fail"
    #: AutoModel's key: DCP ``async_save``. The state is staged into host memory (pinned where a CUDA
    #: device allows it) while training waits; the files are then written in a background thread.
    #: One save in flight at a time; ``LATEST`` and the checksums are written once it completes.
    is_async: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"checkpoint.enabled must be true or false, got {self.enabled!r}")
        if not isinstance(self.save_consolidated, bool) and self.save_consolidated != "final":
            raise ValueError(
                f"checkpoint.save_consolidated must be true, false or final, got {self.save_consolidated!r}"
            )
        if self.dequantize_base_checkpoint not in (None, True, False):
            raise ValueError(
                f"checkpoint.dequantize_base_checkpoint must be true, false or null, got {self.dequantize_base_checkpoint!r}"
            )
        if self.model_save_format not in MODEL_SAVE_FORMATS:
            raise ValueError(
                f"checkpoint.model_save_format must be one of {MODEL_SAVE_FORMATS}, got {self.model_save_format!r}"
            )
        if self.keep_last_n is not None and (
            isinstance(self.keep_last_n, bool)
            or not isinstance(self.keep_last_n, int)
            or self.keep_last_n < 1
        ):
            raise ValueError(
                f"checkpoint.keep_last_n must be None or an integer >= 1, got {self.keep_last_n!r}"
            )
        if self.checkpoint_dir is not None and (
            not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir
        ):
            raise ValueError(
                f"checkpoint.checkpoint_dir must be a non-empty path or None, got {self.checkpoint_dir!r}"
            )
        if self.restore_from is not None and (
            not isinstance(self.restore_from, str) or not self.restore_from
        ):
            raise ValueError(
                f"checkpoint.restore_from must be None, 'LATEST', a step directory or a path, got {self.restore_from!r}"
            )
        if not isinstance(self.is_async, bool):
            raise ValueError(f"checkpoint.is_async must be true or false, got {self.is_async!r}")
        if self.on_corrupt not in ON_CORRUPT:
            raise ValueError(f"checkpoint.on_corrupt must be one of {ON_CORRUPT}, got {self.on_corrupt!r}")
