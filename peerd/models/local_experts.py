"""Local experts (SPES, arXiv 2602.11543): a peer holds every weight for the forward pass but trains only the shared
parameters and its own experts, so gradients and optimizer state exist for those alone.

Bytes are for fp32 parameters: a trained parameter costs 4 bytes of gradient and 8 bytes of AdamW moments
(exp_avg, exp_avg_sq); a frozen one costs neither.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from peerd.models.moe import MoETransformer, expert_parameter_names


def train_only_experts(model: MoETransformer, experts: Iterable[int]) -> list[nn.Parameter]:
    """Freeze every expert not in ``experts`` (``requires_grad = False``); unfreeze the shared parameters and the
    given experts. Returns the trainable parameters in model order: hand exactly these to the optimizer.

    Raises IndexError for an expert id outside [0, n_experts). Calling it again with another subset moves the
    boundary (an optimizer built before keeps its old parameter list: rebuild it).
    """
    own = set(experts)
    for e in own:
        if not 0 <= e < model.config.n_experts:
            raise IndexError(f"expert {e} out of range [0, {model.config.n_experts})")
    frozen = {name for e in range(model.config.n_experts) if e not in own for name in expert_parameter_names(model, e)}
    trainable = []
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
        if name not in frozen:
            trainable.append(param)
    return trainable


def gradient_bytes(model: nn.Module) -> int:
    """Bytes held by the parameters' ``.grad`` tensors right now."""
    return sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (for AdamW: exp_avg, exp_avg_sq and the step
    counters)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v))
