"""Model definitions trained by peerd roles."""

from peerd.models.stages import PipelineStage, build_stage, split_model, stage_bounds
from peerd.models.transformer import MODEL_SIZES, Transformer, TransformerConfig, build_model, count_parameters

__all__ = [
    "MODEL_SIZES", "PipelineStage", "Transformer", "TransformerConfig", "build_model", "build_stage",
    "count_parameters", "split_model", "stage_bounds",
]
