"""Cut a :class:`~peerd.models.transformer.Transformer` into S pipeline stages (SWARM parallelism).

SWARM (Ryabinin et al. 2023, arXiv 2301.11913, section 3) serves a model as consecutive stages, each on several
peers. Here stage k holds the transformer blocks ``stage_bounds(n_layers, S)[k]``; the token embedding rides with
the first stage, the final norm, the LM head and the loss with the last.

Shapes: B = batch, T = sequence length, C = ``d_model``, V = ``vocab_size``.

- first stage (k = 0): int64 token ids (B, T) -> activations (B, T, C) float32;
- middle stage: activations (B, T, C) -> activations (B, T, C);
- last stage (k = S - 1): activations (B, T, C) + targets (B, T) -> loss (scalar, mean cross-entropy in nats per
  token); without targets, logits (B, T, V).

The single-process model ties the LM head to the token embedding. Across stages the tie cannot be kept (the two
ends live on different peers), so with S >= 2 the last stage holds its own head, a copy of the embedding matrix
at split time: at the split the pipeline computes the same function, and the embedding's gradient of the tied model
equals the sum of stage 0's embedding gradient and the last stage's head gradient. With S = 1 the tie is kept.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from peerd.models.transformer import Transformer, build_model

__all__ = ["PipelineStage", "build_stage", "split_model", "stage_bounds"]


def stage_bounds(n_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Block ranges ``[(start, end), ...]`` (end exclusive) of ``num_stages`` stages over ``n_layers`` blocks.

    Blocks are spread as evenly as possible; earlier stages get the extra block (they also hold the embedding,
    which costs no compute). Raises ``ValueError`` unless ``1 <= num_stages <= n_layers``.
    """
    if not isinstance(num_stages, int) or not 1 <= num_stages <= n_layers:
        raise ValueError(f"num_stages must be an int in [1, n_layers={n_layers}], got {num_stages!r}")
    base, extra = divmod(n_layers, num_stages)
    bounds, start = [], 0
    for k in range(num_stages):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class PipelineStage(nn.Module):
    """One stage of a split :class:`Transformer` (see the module docstring for what each stage holds).

    Attributes:
        index: this stage's number k in [0, num_stages).
        num_stages: S.
        first, last: whether this stage takes token ids / computes the loss.
    """

    def __init__(self, model: Transformer, index: int, num_stages: int) -> None:
        """Copy stage ``index``'s parameters out of ``model`` (the model is left untouched)."""
        super().__init__()
        start, end = stage_bounds(model.config.n_layers, num_stages)[index]
        self.config = model.config
        self.index, self.num_stages = index, num_stages
        self.first, self.last = index == 0, index == num_stages - 1
        self.blocks = nn.ModuleList(copy.deepcopy(model.blocks[i]) for i in range(start, end))
        self.tok_emb = copy.deepcopy(model.tok_emb) if self.first else None
        if self.last:
            self.norm = copy.deepcopy(model.norm)
            # S = 1 keeps the tie; otherwise the head is the last stage's own copy of the embedding matrix.
            self.head = None if self.first else nn.Parameter(model.tok_emb.weight.detach().clone())
        else:
            self.norm, self.head = None, None
        self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)

    def head_weight(self) -> torch.Tensor:
        """The LM head matrix (V, C) of the last stage."""
        return self.tok_emb.weight if self.head is None else self.head

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage.

        Args:
            x: token ids (B, T) int64 on the first stage; activations (B, T, C) float on the others.
            targets: next-token ids (B, T) int64; only on the last stage (``None`` there returns logits).

        Returns:
            activations (B, T, C) on a non-last stage; on the last stage the loss (scalar) with targets, logits
            (B, T, V) without.

        Raises:
            ValueError: ``x`` has the wrong rank or dtype for this stage, T exceeds ``seq_len``, or targets are
                given to a non-last stage or do not match (B, T).
        """
        if self.first:
            if x.dim() != 2 or x.dtype != torch.long:
                raise ValueError(f"stage 0 takes int64 token ids (B, T), got {x.dtype} {tuple(x.shape)}")
        elif x.dim() != 3 or x.shape[-1] != self.config.d_model or not x.is_floating_point():
            raise ValueError(f"stage {self.index} takes activations (B, T, {self.config.d_model}), got "
                             f"{x.dtype} {tuple(x.shape)}")
        T = x.shape[1]
        if T > self.config.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.config.seq_len}")
        if targets is not None and (not self.last or tuple(targets.shape) != tuple(x.shape[:2])):
            raise ValueError(f"targets (B, T) only go to the last stage, got {tuple(targets.shape)} at stage "
                             f"{self.index} for input {tuple(x.shape)}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, D/2)
        if self.first:
            x = self.tok_emb(x)  # (B, T, C)
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, C)
        if not self.last:
            return x
        logits = F.linear(self.norm(x), self.head_weight())  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def split_model(model: Transformer, num_stages: int) -> list[PipelineStage]:
    """All ``num_stages`` stages of ``model`` (copies; ``model`` is unchanged). Raises ``ValueError`` as
    :func:`stage_bounds`."""
    stage_bounds(model.config.n_layers, num_stages)
    return [PipelineStage(model, k, num_stages) for k in range(num_stages)]


def build_stage(size: str, seq_len: int, seed: int, index: int, num_stages: int,
                device: str | torch.device = "cpu", vocab_size: int = 256) -> PipelineStage:
    """Stage ``index`` of ``num_stages`` of :func:`build_model` ``(size, seq_len, seed, vocab_size)`` on
    ``device``.

    Every peer that builds the same stage with the same arguments holds bit-identical parameters. (The whole model
    is built on the CPU first so the initial draws do not depend on the split; fine for the preset sizes.)
    Raises ``ValueError`` for an unknown size, a bad ``seq_len`` or a stage out of range.
    """
    if not isinstance(index, int) or not 0 <= index < num_stages:
        raise ValueError(f"stage index must be in [0, {num_stages}), got {index!r}")
    model = build_model(size, seq_len=seq_len, seed=seed, vocab_size=vocab_size)
    stage_bounds(model.config.n_layers, num_stages)
    return PipelineStage(model, index, num_stages).to(device)
