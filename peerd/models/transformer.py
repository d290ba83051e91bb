"""A small decoder-only transformer language model (pre-norm, RoPE, SwiGLU, tied embeddings).

Shapes: B = batch, T = sequence length (<= ``seq_len``), C = ``d_model``, H = ``n_heads``, D = head dim (C // H),
V = ``vocab_size``. Losses are mean cross-entropy in nats per token.

Construction never touches the global RNG: weights are allocated uninitialised and then drawn from a local
``torch.Generator``, so every peer that builds the same size with the same seed holds bit-identical parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# Counted with count_parameters (vocab 256, independent of seq_len since RoPE has no weights); the table with memory
# per preset is in README.md and tests/unit/test_model_registry.py checks the counts.
#   tiny  =    885,888 parameters
#   small = 10,720,128 parameters
#   125m, 350m, 1.1b: Llama-style widths (SwiGLU hidden ~8/3 d_model rounded to a multiple of 256; 1.1b has
#   TinyLlama's width, depth and MLP, with full multi-head attention)
MODEL_SIZES: dict[str, dict] = {
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, mlp_hidden=384),
    "small": dict(d_model=384, n_layers=6, n_heads=6, mlp_hidden=1024),
    "125m": dict(d_model=768, n_layers=18, n_heads=12, mlp_hidden=2048),
    "350m": dict(d_model=1024, n_layers=27, n_heads=16, mlp_hidden=2816),
    "1.1b": dict(d_model=2048, n_layers=22, n_heads=32, mlp_hidden=5632),
}

INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Architecture of a :class:`Transformer`; validated on construction (raises ``ValueError``)."""

    vocab_size: int = 256
    """Number of token ids (256 for the byte tokenizer)."""
    seq_len: int
    """Longest sequence the model accepts, in tokens; sizes the RoPE tables."""
    d_model: int
    """Width of the residual stream."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Attention heads per block; must divide ``d_model`` into an even head dim (RoPE rotates pairs)."""
    mlp_hidden: int
    """Hidden width of the SwiGLU MLP."""
    rope_base: float = 10000.0
    """Base of the RoPE frequencies (theta in RoFormer)."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorms."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TransformerConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head dim d_model // n_heads = {self.head_dim} must be even for RoPE")
        if self.rope_base <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_base ({self.rope_base}) and norm_eps ({self.norm_eps}) must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _rms_norm(dim: int, eps: float) -> nn.Module:
    # torch.nn.RMSNorm exists from torch 2.4; setup.cfg still allows torch 2.2.
    if hasattr(nn, "RMSNorm"):
        return nn.RMSNorm(dim, eps=eps)
    return _RMSNorm(dim, eps)


class _RMSNorm(nn.Module):
    """RMSNorm for torch < 2.4, same parameter name (``weight``) and math as ``torch.nn.RMSNorm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope_tables(config: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE angles, each (seq_len, D // 2) float32."""
    half = config.head_dim // 2
    inv_freq = config.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)  # (D/2,)
    angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float64), inv_freq)  # (seq_len, D/2)
    return angles.cos().float(), angles.sin().float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the (first half, second half) pairs of x: (B, H, T, D) by cos/sin: (T, D/2)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, T, D)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.utils.skip_init(nn.Linear, config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.utils.skip_init(nn.Linear, config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)  # (B, T, C) each
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class SwiGLU(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.gate = nn.utils.skip_init(nn.Linear, config.d_model, config.mlp_hidden, bias=False)
        self.up = nn.utils.skip_init(nn.Linear, config.d_model, config.mlp_hidden, bias=False)
        self.proj = nn.utils.skip_init(nn.Linear, config.mlp_hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = _rms_norm(config.d_model, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = _rms_norm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


@torch.no_grad()
def init_weights(model: nn.Module, n_layers: int, seed: int) -> None:
    """GPT-2 initialisation, deterministic for ``seed``: norms 1, residual-branch outputs (``*proj.weight``) normal
    with std INIT_STD / sqrt(2 * n_layers) so the residual stream's variance does not grow with depth, everything
    else normal with std INIT_STD. Draw order is ``named_parameters()`` order, fixed by the architecture (each MoE
    expert draws its own weights, so experts start distinct)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * n_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("proj.weight"):
            param.copy_(torch.normal(0.0, residual_std, param.shape, generator=generator))
        else:
            param.copy_(torch.normal(0.0, INIT_STD, param.shape, generator=generator))


class Transformer(nn.Module):
    """Decoder-only language model; the LM head reuses the token embedding matrix.

    ``parameters()`` / ``state_dict()`` hold exactly the trainable weights (no biases, RoPE tables are
    non-persistent buffers), so a flat parameter vector is the same on every peer of a run.
    """

    def __init__(self, config: TransformerConfig, seed: int = 0) -> None:
        """Build and initialise from ``seed`` with a local generator (the global RNG is left untouched)."""
        super().__init__()
        self.config = config
        self.tok_emb = nn.utils.skip_init(nn.Embedding, config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = _rms_norm(config.d_model, config.norm_eps)
        cos, sin = _rope_tables(config)
        # Non-persistent: derived from the config, so they stay out of checkpoints and averaged state.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = False
        """Recompute each block's activations during backward instead of keeping them (training only)."""
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        init_weights(self, self.config.n_layers, seed)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits and, given targets, the loss.

        Args:
            idx: int64 token ids, (B, T) with T <= ``config.seq_len``.
            targets: optional int64 next-token ids, (B, T).

        Returns:
            ``(logits, loss)``: logits (B, T, V) float; loss = mean cross-entropy in nats per token, or ``None``
            without targets.

        Raises:
            ValueError: ``idx`` is not 2-D or T exceeds ``config.seq_len``.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T), got shape {tuple(idx.shape)}")
        T = idx.shape[1]
        if T > self.config.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.config.seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, D/2)
        x = self.tok_emb(idx)  # (B, T, C)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if recompute:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)  # (B, T, C)
            else:
                x = block(x, cos, sin)  # (B, T, C)
        logits = F.linear(self.norm(x), self.tok_emb.weight)  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def build_model(size: str, seq_len: int, seed: int, vocab_size: int = 256) -> Transformer:
    """A :class:`Transformer` of preset ``size`` (a key of ``MODEL_SIZES``) over ``vocab_size`` tokens (256 =
    bytes), deterministically initialised.

    Same ``(size, seq_len, seed, vocab_size)`` -> bit-identical parameters in any process. Raises ``ValueError``
    for an unknown size or an invalid ``seq_len``.
    """
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; valid sizes: {', '.join(sorted(MODEL_SIZES))}")
    return Transformer(TransformerConfig(seq_len=seq_len, vocab_size=vocab_size, **MODEL_SIZES[size]), seed=seed)


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters, counting a tied weight once."""
    return sum(p.numel() for p in model.parameters())
