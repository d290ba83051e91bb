"""The inner side of a DiLoCo worker: the inner AdamW and its learning-rate schedule, and the flat parameter vectors
that carry a model's parameters to and from the outer state."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from protocols.diloco.hyperparams import DiLoCoHyperparams, _is_int, _is_real


# ---------------------------------------------------------------------------------------------------------------
# Inner optimizer and learning-rate schedule


def make_inner_optimizer(params: Iterable[torch.nn.Parameter] | Iterable[dict], hp: DiLoCoHyperparams,
                         device_type: str = "cpu") -> torch.optim.AdamW:
    """Inner AdamW with ``hp``'s betas and weight decay, lr initialized to ``hp.inner_lr``.

    ``device_type`` is where the parameters live (``torch.device.type``): ``"cuda"`` selects the fused kernel (one
    launch for all parameters); elsewhere torch's default implementation (foreach where it supports it), so the
    CPU arithmetic is the same as before. Contract: call ``set_lr(opt, inner_lr_at(step, hp))`` before every
    ``opt.step()`` so the schedule applies.
    """
    extra = {"fused": True} if device_type == "cuda" else {}
    return torch.optim.AdamW(params, lr=hp.inner_lr, betas=hp.inner_betas, weight_decay=hp.inner_weight_decay,
                             **extra)


def inner_lr_at(step: int, hp: DiLoCoHyperparams) -> float:
    """Inner learning rate for global inner step ``step`` (0-based).

    ``step = outer_round * hp.inner_steps + local_step``, so a peer that joins late continues the schedule. Linear
    warm-up ``inner_lr * (step + 1) / warmup_steps`` for ``step < warmup_steps`` (never exactly 0, so the first step
    moves), then ``inner_lr`` constant if ``lr_decay_steps == 0``, else half-cosine down to
    ``min_lr_ratio * inner_lr`` over ``lr_decay_steps`` steps, then that floor. Raises ``ValueError`` if step < 0.
    """
    if not _is_int(step) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if step < hp.warmup_steps:
        return hp.inner_lr * (step + 1) / hp.warmup_steps
    if hp.lr_decay_steps == 0:
        return hp.inner_lr
    progress = min(1.0, (step - hp.warmup_steps) / hp.lr_decay_steps)
    floor = hp.min_lr_ratio * hp.inner_lr
    return floor + (hp.inner_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set ``lr`` on every param group of ``optimizer``. Raises ``ValueError`` if lr is negative or not finite."""
    if not _is_real(lr) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    for group in optimizer.param_groups:
        group["lr"] = float(lr)


# ---------------------------------------------------------------------------------------------------------------
# Flat parameter vectors


def flatten_parameters(module: torch.nn.Module) -> torch.Tensor:
    """Fresh fp32 CPU copy of all of ``module.parameters()``, concatenated in that order. Returns (P,)."""
    params = list(module.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)  # (P,)
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset:offset + n].copy_(p.detach().reshape(-1))
        offset += n
    return flat


def load_flat_parameters_(module: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` (P,) into ``module.parameters()`` in place, converting to each parameter's device and dtype.

    Inverse of :func:`flatten_parameters`. Raises ``ValueError`` if ``flat`` is not 1-D or its numel is not P.
    """
    params = list(module.parameters())
    total = sum(p.numel() for p in params)
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D tensor, got {type(flat).__name__} "
                         f"{tuple(flat.shape) if isinstance(flat, torch.Tensor) else ''}")
    if flat.numel() != total:
        raise ValueError(f"flat has {flat.numel()} elements but the module has {total} parameters")
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view(p.shape))
            offset += n
