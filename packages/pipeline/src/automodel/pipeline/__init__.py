"""automodel.pipeline: pipeline parallelism with every torch schedule, usable on its own.

`AutoPipeline(mesh=..., config=PipelineConfig(...)).build(model, loss_fn=..., parallelize_fn=...)`
cuts a model (a Hugging Face causal LM, or any module with explicit FQN lists) into this rank's
stages and returns a `PipelineModel` with `step`/`eval`.
"""

from automodel.pipeline._version import __version__ as __version__
from automodel.pipeline.autopipeline import LABEL_PAD, AutoPipeline, PipelineModel
from automodel.pipeline.config import PipelineConfig
from automodel.pipeline.dtensor_boundary import BoundaryLayout
from automodel.pipeline.forward_only import PipelineStageError
from automodel.pipeline.hf import (
    hf_module_fqns_per_stage,
    is_hf_causal_lm,
    validate_hf_model_for_pipeline_support,
)
from automodel.pipeline.hf_stage import CausalLMStage
from automodel.pipeline.hf_structure import HFStructure, PipelineSplitError, trace_hf_structure
from automodel.pipeline.layer_forward import LayerListForward, LayerListStage
from automodel.pipeline.layout import num_stages_for, split_layers_evenly, stage_ids_this_rank
from automodel.pipeline.schedules import ScheduleSpec, known_schedule_names, resolve_schedule
from automodel.pipeline.split import check_parameter_coverage, split_module

__all__ = [
    "LABEL_PAD",
    "AutoPipeline",
    "BoundaryLayout",
    "CausalLMStage",
    "HFStructure",
    "LayerListForward",
    "LayerListStage",
    "PipelineConfig",
    "PipelineModel",
    "PipelineSplitError",
    "PipelineStageError",
    "ScheduleSpec",
    "check_parameter_coverage",
    "hf_module_fqns_per_stage",
    "is_hf_causal_lm",
    "known_schedule_names",
    "num_stages_for",
    "resolve_schedule",
    "split_layers_evenly",
    "split_module",
    "stage_ids_this_rank",
    "trace_hf_structure",
    "validate_hf_model_for_pipeline_support",
]
