"""The model registry: every name a run config's ``model`` may hold, its family and its shape.

Dense presets (:data:`peerd.models.transformer.MODEL_SIZES`) are Llama-style decoder-only transformers (RoPE,
RMSNorm, SwiGLU, tied embeddings, no biases); mixture-of-experts presets (:data:`peerd.models.moe.MOE_SIZES`) swap
the MLP for routed experts. Sizes are counted from shapes, so a test can check a 1.1B preset without allocating it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from torch import nn

from peerd.models.moe import MOE_SIZES, MoEConfig, MoETransformer
from peerd.models.transformer import MODEL_SIZES, Transformer, TransformerConfig

BYTE_VOCAB = 256
#: Bytes per parameter of a training peer's model state on its device: fp32 weights (4), fp32 gradients (4) and
#: AdamW's two fp32 moments (8). Mixed precision keeps fp32 master weights, so it does not lower this.
TRAIN_STATE_BYTES_PER_PARAM = 16
#: Bytes per parameter of DiLoCo's outer state, held in host memory: theta_outer and the outer momentum (fp32).
OUTER_STATE_BYTES_PER_PARAM = 8


@dataclass(frozen=True)
class ModelPreset:
    """One named architecture."""

    name: str
    family: str
    """``dense`` (:class:`Transformer`) or ``moe`` (:class:`MoETransformer`)."""
    shape: Mapping[str, int] = field(repr=False)
    """Keyword arguments of the family's config besides ``seq_len`` and ``vocab_size``."""

    def config(self, seq_len: int, vocab_size: int = BYTE_VOCAB) -> TransformerConfig:
        """The architecture at ``seq_len`` tokens; raises ``ValueError`` for invalid sizes."""
        cls = MoEConfig if self.family == "moe" else TransformerConfig
        return cls(seq_len=seq_len, vocab_size=vocab_size, **self.shape)

    def build(self, seq_len: int, seed: int, vocab_size: int = BYTE_VOCAB) -> nn.Module:
        """The model, deterministically initialised from ``seed`` (same arguments -> bit-identical weights)."""
        config = self.config(seq_len, vocab_size)
        return MoETransformer(config, seed=seed) if self.family == "moe" else Transformer(config, seed=seed)

    def parameter_count(self, vocab_size: int = BYTE_VOCAB) -> int:
        """Scalar parameters, counted from shapes (the tied LM head once); equals ``count_parameters(build(...))``.
        Independent of ``seq_len``: RoPE has no weights."""
        s = self.shape
        d, layers = s["d_model"], s["n_layers"]
        if self.family == "moe":
            # experts + router; the MoE attention also has RMSNorm weights on q and k (head dim each)
            mlp = s["n_experts"] * 3 * d * s["mlp_hidden"] + s["n_experts"] * d + 2 * (d // s["n_heads"])
        else:
            mlp = 3 * d * s["mlp_hidden"]  # SwiGLU gate, up, down
        block = 2 * d + 4 * d * d + mlp  # two RMSNorm weights, qkv + output projection, MLP
        return vocab_size * d + layers * block + d  # embedding (= LM head), blocks, final RMSNorm

    def train_state_bytes(self, vocab_size: int = BYTE_VOCAB) -> int:
        """Device memory of weights, gradients and AdamW moments (activations come on top and scale with the
        micro-batch)."""
        return TRAIN_STATE_BYTES_PER_PARAM * self.parameter_count(vocab_size)


MODEL_PRESETS: dict[str, ModelPreset] = {
    **{name: ModelPreset(name, "dense", shape) for name, shape in MODEL_SIZES.items()},
    **{name: ModelPreset(name, "moe", shape) for name, shape in MOE_SIZES.items()},
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; raises ``ValueError`` naming the valid ones."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model size {name!r}; valid sizes: {', '.join(sorted(MODEL_PRESETS))}") from None
