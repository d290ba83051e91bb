"""Model definitions trained by peerd roles."""

from peerd.models.stages import PipelineStage, build_stage, split_model, stage_bounds
from peerd.models.transformer import MODEL_SIZES, Transformer, TransformerConfig, build_model, count_parameters

__all__ = [
    "MODEL_SIZES", "PipelineStage", "build_stage", "split_model", "stage_bounds", "Transformer", "TransformerConfig", "build_model", "count_parameters"]
