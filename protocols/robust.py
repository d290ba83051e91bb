"""Robust aggregation: CenteredClip (Karimireddy, He & Jaggi 2021), as used by BTARD (Gorbunov et al. 2022).

Starting from the coordinate-wise median v_0 of the inputs x_1..x_n (weights w_i), iterate

    v_{l+1} = v_l + sum_i w_i * clip(x_i - v_l, tau) / sum_i w_i,    clip(z, tau) = z * min(1, tau / ||z||)

``iterations`` times (BTARD: 20 iterations, tau in {1, 10}). An input far from the honest majority moves v by at
most tau * w_i / sum w per iteration, however large it is, so a minority of arbitrarily scaled or flipped inputs
cannot drag the result away; with all inputs within tau of each other, it equals the weighted mean.

Pure tensor math, no I/O. In the butterfly all-reduce each reducer applies it to its own part of the vector.
"""

from __future__ import annotations

from typing import Sequence

import torch

AGGREGATIONS = ("mean", "centered_clip")


def weighted_coordinate_median(parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-coordinate weighted median of ``parts`` (n, P) with ``weights`` (n,) >= 0; returns (P,)."""
    order = torch.argsort(parts, dim=0)  # (n, P)
    sorted_parts = torch.gather(parts, 0, order)
    cumulative = torch.cumsum(weights[order], dim=0)  # (n, P)
    half = cumulative[-1] / 2  # (P,)
    index = torch.searchsorted(cumulative.T.contiguous(), half.unsqueeze(1)).squeeze(1).clamp(max=parts.shape[0] - 1)
    return sorted_parts.gather(0, index.unsqueeze(0)).squeeze(0)


def centered_clip(
    parts: Sequence[torch.Tensor], weights: Sequence[float], tau: float = 1.0, iterations: int = 20
) -> torch.Tensor:
    """CenteredClip of fp32 vectors ``parts`` (each (P,)) with non-negative ``weights``; returns (P,) fp32.

    Raises ValueError for an empty input, mismatched lengths, tau <= 0, iterations < 0 or zero total weight.
    """
    if not parts or len(parts) != len(weights):
        raise ValueError("need as many weights as parts, and at least one part")
    if tau <= 0 or iterations < 0:
        raise ValueError(f"need tau > 0 and iterations >= 0, got {tau}, {iterations}")
    x = torch.stack([p.float() for p in parts])  # (n, P)
    w = torch.tensor([float(v) for v in weights], dtype=torch.float32)  # (n,)
    if float(w.sum()) <= 0:
        raise ValueError("total weight must be positive")
    w = w / w.sum()
    v = weighted_coordinate_median(x, w)  # (P,)
    for _ in range(iterations):
        diff = x - v  # (n, P)
        norms = diff.norm(dim=1).clamp_min(1e-12)  # (n,)
        scale = torch.clamp(tau / norms, max=1.0)  # (n,)
        v = v + (w * scale) @ diff
    return v
