"""A mixture-of-experts variant of :mod:`peerd.models.transformer` (the model SPES trains).

Shared: token embedding (tied LM head), attention with QK-norm and RoPE, RMSNorms and the routers. Routed: per block
``n_experts`` SwiGLU expert MLPs, each token sent to its ``top_k`` experts by a linear router (softmax, top-k, the k
probabilities renormalised to sum to 1, as in Mixtral, Jiang et al. 2024). A load-balancing auxiliary loss (Switch
Transformer, Fedus et al. 2021, eq. 4) keeps the routing spread out; SPES (arXiv 2602.11543) trains this model with
each peer owning a subset of the experts (:mod:`protocols.spes`, :mod:`peerd.models.local_experts`).

Shapes: B = batch, T = sequence length (<= ``seq_len``), N = B * T tokens, C = ``d_model``, H = ``n_heads``,
D = head dim, E = ``n_experts``, K = ``top_k``, V = ``vocab_size``. Losses are in nats per token.

Parameter names of expert ``e`` in block ``l``: ``blocks.{l}.moe.experts.{e}.*`` (:func:`expert_parameter_names`);
everything else is shared. Construction never touches the global RNG (same seed -> bit-identical parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from peerd.models.transformer import SwiGLU, TransformerConfig, _apply_rope, _rms_norm, _rope_tables, init_weights

# Measured with count_parameters (vocab 256):
#   tiny-moe  =  2,659,712 parameters (expert MLPs 2,359,296 of them)
#   small-moe = 46,147,200 parameters (expert MLPs 42,467,328 of them)
MOE_SIZES: dict[str, dict] = {
    "tiny-moe": dict(d_model=128, n_layers=4, n_heads=4, mlp_hidden=192, n_experts=8, top_k=2),
    "small-moe": dict(d_model=384, n_layers=6, n_heads=6, mlp_hidden=384, n_experts=16, top_k=2),
}


@dataclass(frozen=True, kw_only=True)
class MoEConfig(TransformerConfig):
    """Architecture of a :class:`MoETransformer`; ``mlp_hidden`` is the hidden width of ONE expert.
    Validated on construction (raises ``ValueError``)."""

    n_experts: int
    """Routed experts per block (E)."""
    top_k: int = 2
    """Experts each token is sent to (K <= E)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss in the training loss (Switch Transformer uses 0.01)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.n_experts, int) or self.n_experts <= 0:
            raise ValueError(f"MoEConfig.n_experts must be a positive int, got {self.n_experts!r}")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MoEConfig.top_k must be an int in [1, n_experts={self.n_experts}], got {self.top_k!r}")
        if not (math.isfinite(self.aux_loss_coef) and self.aux_loss_coef >= 0):
            raise ValueError(f"MoEConfig.aux_loss_coef must be finite and >= 0, got {self.aux_loss_coef!r}")


class QKNormAttention(nn.Module):
    """Causal self-attention with RMSNorm on each head's queries and keys before RoPE (QK-norm, Dehghani et al.
    2023): it bounds the attention logits, which keeps independently trained peers' averages stable."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.utils.skip_init(nn.Linear, config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.utils.skip_init(nn.Linear, config.d_model, config.d_model, bias=False)
        self.q_norm = _rms_norm(config.head_dim, config.norm_eps)
        self.k_norm = _rms_norm(config.head_dim, config.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)  # (B, T, C) each
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        q, k = _apply_rope(self.q_norm(q), cos, sin), _apply_rope(self.k_norm(k), cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4), generalised to top-k.

    ``E * sum_e f_e * P_e``, with f_e the fraction of the N*K routing slots that went to expert e and P_e the mean
    router probability of e. It is 1 when the router probabilities are uniform (whatever the choice) and grows as the
    router concentrates tokens on few experts.

    Args:
        probs: router softmax, (N, E) float.
        chosen: chosen expert ids, (N, K) int64.
        n_experts: E.

    Returns:
        A scalar tensor (differentiable through ``probs``).
    """
    counts = torch.zeros(n_experts, device=probs.device, dtype=probs.dtype)
    counts.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device, dtype=probs.dtype))
    f = counts / chosen.numel()  # (E,)
    return n_experts * torch.sum(f * probs.mean(dim=0))


class MoELayer(nn.Module):
    """Top-k routed SwiGLU experts. ``last_chosen`` / ``last_aux_loss``: the routing of the latest forward (N, K) and
    its load-balancing loss (a scalar), kept for the model's loss and for inspection."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.n_experts = config.n_experts
        self.router = nn.utils.skip_init(nn.Linear, config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(config) for _ in range(config.n_experts))
        self.last_chosen: torch.Tensor | None = None
        self.last_aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        tokens = x.reshape(-1, C)  # (N, C)
        probs = F.softmax(self.router(tokens).float(), dim=-1)  # (N, E)
        top_p, chosen = probs.topk(self.top_k, dim=-1)  # (N, K) each
        gates = (top_p / top_p.sum(dim=-1, keepdim=True)).to(x.dtype)  # (N, K)
        out = torch.zeros_like(tokens)  # (N, C)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.nonzero(chosen == e, as_tuple=True)  # (n_e,) each
            if token_idx.numel() == 0:
                continue  # an expert no token chose stays out of the graph: it gets no gradient at all
            y = expert(tokens[token_idx]) * gates[token_idx, slot].unsqueeze(-1)  # (n_e, C)
            out.index_add_(0, token_idx, y)
        self.last_chosen = chosen
        self.last_aux_loss = load_balancing_loss(probs, chosen, self.n_experts)
        return out.view(B, T, C)


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = _rms_norm(config.d_model, config.norm_eps)
        self.attn = QKNormAttention(config)
        self.mlp_norm = _rms_norm(config.d_model, config.norm_eps)
        self.moe = MoELayer(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, C)
        return x + self.moe(self.mlp_norm(x))  # (B, T, C)


class MoETransformer(nn.Module):
    """Decoder-only MoE language model; the LM head reuses the token embedding matrix.

    ``forward(idx, targets)`` returns ``(logits, loss)`` like :class:`peerd.models.Transformer`; with targets, loss =
    cross-entropy + ``aux_loss_coef`` * mean over blocks of the load-balancing loss in training mode, the
    cross-entropy alone in eval mode (so evaluation reports nats per token, comparable with the dense model). ``last_ce_loss`` and
    ``last_aux_loss`` hold the two terms of the latest forward (scalars, detached).
    """

    def __init__(self, config: MoEConfig, seed: int = 0) -> None:
        """Build and initialise from ``seed`` with a local generator (the global RNG is left untouched)."""
        super().__init__()
        self.config = config
        self.tok_emb = nn.utils.skip_init(nn.Embedding, config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layers))
        self.norm = _rms_norm(config.d_model, config.norm_eps)
        cos, sin = _rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.last_ce_loss: torch.Tensor | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        # the dense model's scheme; each expert draws its own weights, so experts start distinct (identical experts
        # would receive identical updates forever)
        init_weights(self, self.config.n_layers, seed)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits and, given targets, the training loss.

        Args:
            idx: int64 token ids, (B, T) with T <= ``config.seq_len``.
            targets: optional int64 next-token ids, (B, T).

        Returns:
            ``(logits, loss)``: logits (B, T, V); loss = cross-entropy (nats/token), + aux_loss_coef * aux in training
            mode; None without targets.

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
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, C)
        logits = F.linear(self.norm(x), self.tok_emb.weight)  # (B, T, V)
        aux = torch.stack([block.moe.last_aux_loss for block in self.blocks]).mean()
        self.last_aux_loss = aux.detach()
        if targets is None:
            return logits, None
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        self.last_ce_loss = ce.detach()
        return logits, (ce + self.config.aux_loss_coef * aux) if self.training else ce

    def routing(self) -> list[torch.Tensor]:
        """The experts chosen in the latest forward, one (N, K) int64 tensor per block."""
        return [block.moe.last_chosen for block in self.blocks]


def expert_parameter_names(model: MoETransformer, expert: int) -> tuple[str, ...]:
    """Names (``named_parameters`` order) of expert ``expert``'s weights in every block. Raises IndexError."""
    if not 0 <= expert < model.config.n_experts:
        raise IndexError(f"expert {expert} out of range [0, {model.config.n_experts})")
    marks = tuple(f"blocks.{layer}.moe.experts.{expert}." for layer in range(model.config.n_layers))
    return tuple(name for name, _ in model.named_parameters() if name.startswith(marks))


def shared_parameter_names(model: MoETransformer) -> tuple[str, ...]:
    """Names of every parameter that is not an expert's (embeddings, attention, norms, routers)."""
    return tuple(name for name, _ in model.named_parameters() if ".moe.experts." not in name)


def build_moe_model(size: str, seq_len: int, seed: int) -> MoETransformer:
    """A :class:`MoETransformer` of preset ``size`` (a key of ``MOE_SIZES``), deterministically initialised.
    Raises ``ValueError`` for an unknown size or an invalid ``seq_len``."""
    if size not in MOE_SIZES:
        raise ValueError(f"unknown MoE model size {size!r}; valid sizes: {', '.join(sorted(MOE_SIZES))}")
    return MoETransformer(MoEConfig(seq_len=seq_len, **MOE_SIZES[size]), seed=seed)
