"""Model definitions trained by peerd roles."""

from peerd.models.transformer import MODEL_SIZES, Transformer, TransformerConfig, build_model, count_parameters

__all__ = ["MODEL_SIZES", "Transformer", "TransformerConfig", "build_model", "count_parameters"]
