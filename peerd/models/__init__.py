"""Model definitions trained by peerd roles."""

from torch import nn

from peerd.models.registry import MODEL_PRESETS, ModelPreset, get_preset
from peerd.models.moe import MOE_SIZES, MoEConfig, MoETransformer, build_moe_model
from peerd.models.stages import PipelineStage, build_stage, split_model, stage_bounds
from peerd.models.transformer import MODEL_SIZES, Transformer, TransformerConfig, count_parameters


def build_model(size: str, seq_len: int, seed: int, vocab_size: int = 256) -> nn.Module:
    """The model of a run config's ``model`` name (a key of :data:`MODEL_PRESETS`): a dense :class:`Transformer`
    (``MODEL_SIZES``) or a :class:`MoETransformer` (``MOE_SIZES``), deterministically initialised; both return
    ``(logits, loss)``. ``vocab_size``: the run's tokenizer's (256 = bytes). Raises ``ValueError`` for an unknown
    name or an invalid ``seq_len``."""
    return get_preset(size).build(seq_len, seed, vocab_size)


__all__ = ["MODEL_PRESETS", "MODEL_SIZES", "MOE_SIZES", "ModelPreset", "MoEConfig", "MoETransformer", "PipelineStage",
           "Transformer", "TransformerConfig", "build_model", "build_moe_model", "build_stage", "count_parameters",
           "get_preset", "split_model", "stage_bounds"]
