"""Model definitions trained by peerd roles."""

from torch import nn

from peerd.models.moe import MOE_SIZES, MoEConfig, MoETransformer, build_moe_model
from peerd.models.stages import PipelineStage, build_stage, split_model, stage_bounds
from peerd.models.transformer import MODEL_SIZES, Transformer, TransformerConfig, count_parameters
from peerd.models.transformer import build_model as build_dense_model


def build_model(size: str, seq_len: int, seed: int) -> nn.Module:
    """The model of a run config's ``model`` name: a dense :class:`Transformer` (``MODEL_SIZES``) or a
    :class:`MoETransformer` (``MOE_SIZES``), deterministically initialised; both return ``(logits, loss)``.
    Raises ``ValueError`` for an unknown name or an invalid ``seq_len``."""
    if size in MOE_SIZES:
        return build_moe_model(size, seq_len, seed)
    if size not in MODEL_SIZES:
        valid = ", ".join(sorted([*MODEL_SIZES, *MOE_SIZES]))
        raise ValueError(f"unknown model size {size!r}; valid sizes: {valid}")
    return build_dense_model(size, seq_len, seed)


__all__ = ["MODEL_SIZES", "MOE_SIZES", "MoEConfig", "MoETransformer", "PipelineStage", "Transformer",
           "TransformerConfig", "build_model", "build_moe_model", "build_stage", "count_parameters", "split_model",
           "stage_bounds"]
