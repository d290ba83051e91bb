"""DiLoCo's hyperparameters (:class:`DiLoCoHyperparams`), validated at construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------------------------
# Hyperparameters

#: How an outer round's all-reduce relates to the next round's inner steps (run config ``[diloco] overlap``).
OVERLAPS = ("none", "delayed")
#: What a worker that missed a round does with its local steps (run config ``[diloco] straggler``).
STRAGGLERS = ("drop", "carry")


@dataclass(frozen=True)
class DiLoCoHyperparams:
    """DiLoCo hyperparameters; defaults are the paper's (arXiv 2311.08105, section 3).

    Raises ``ValueError`` at construction naming the offending field. Integer values given for float fields (as
    TOML may produce) are converted to float; ``inner_betas`` may be given as a list.
    """

    inner_steps: int = 500
    """H: inner AdamW steps between two outer steps (>= 1)."""

    inner_lr: float = 4e-4
    """Peak inner AdamW learning rate, reached at the end of warm-up (> 0)."""

    inner_weight_decay: float = 0.1
    """Inner AdamW decoupled weight decay (>= 0)."""

    inner_betas: tuple[float, float] = (0.9, 0.95)
    """Inner AdamW (beta1, beta2), each in [0, 1)."""

    warmup_steps: int = 1000
    """Global inner steps of linear learning-rate warm-up from ~0 to ``inner_lr`` (>= 0; 0 disables warm-up)."""

    lr_decay_steps: int = 0
    """Global inner steps of cosine decay after warm-up, from ``inner_lr`` to ``min_lr_ratio * inner_lr``; the lr
    then stays at that floor. 0 keeps the lr constant after warm-up (>= 0)."""

    min_lr_ratio: float = 0.1
    """Floor of the cosine decay as a fraction of ``inner_lr``, in [0, 1]; unused when ``lr_decay_steps == 0``."""

    outer_lr: float = 0.7
    """Outer SGD learning rate applied to the averaged pseudo-gradient (> 0)."""

    outer_momentum: float = 0.9
    """Outer SGD momentum mu, in [0, 1). With 0 the outer step is plain SGD (Nesterov or not)."""

    outer_nesterov: bool = True
    """Use Nesterov momentum in the outer step (as ``torch.optim.SGD(nesterov=True)``)."""

    grad_clip_norm: float = 1.0
    """Max global L2 norm of inner gradients before each inner step (> 0), or 0 to disable clipping."""

    overlap: str = "none"
    """none: each round's all-reduce finishes before the next inner steps. delayed: it runs in the background while
    the next round's inner steps go on from theta_local; its outer step is applied as soon as it finishes and
    theta_local is merged with the new theta_outer (:class:`DelayedOuterStep`; Streaming DiLoCo, arXiv 2501.18512)."""

    overlap_mix: float = 0.5
    """alpha of the merge after a background outer step (``overlap = "delayed"``): ``theta_local <- alpha *
    theta_local + (1 - alpha) * theta_outer``, in [0, 1]. 0 restarts from theta_outer (the local steps taken during
    the all-reduce are dropped), 1 keeps theta_local (they are kept, but the worker never hears the others); Streaming
    DiLoCo (arXiv 2501.18512, sec. 2.3) mixes half and half."""

    straggler: str = "drop"
    """What a worker does with its local steps when the others completed a round without it (it came after the
    matchmaking deadline): drop (adopt their state and restart from it) or carry (adopt their state and keep its
    pseudo-gradient, taken against the state it started from, for the next round: theta_local := theta_outer_new -
    delta, weighted by all the samples it covers). carry applies when the swarm is exactly one round ahead and
    ``overlap = "none"``, ``fragments = 1``; a state further ahead is too stale: dropped."""

    fragments: int = 1
    """F: Streaming DiLoCo fragments (arXiv 2501.18512): the model is cut into F strided fragments, each with its own
    outer state and outer round every H steps, staggered by H/F steps (:mod:`protocols.streaming`); F divides H.
    1 syncs the whole model at once. With ``overlap = "delayed"`` each fragment's all-reduce runs in the background
    while the next inner steps go on, until the next fragment's boundary."""

    error_feedback_decay: float = 1.0
    """beta of the sparse codecs' error feedback (``compression = "topk"``): ``e <- beta e + delta`` before each
    round's top-k (:class:`protocols.codecs.ErrorFeedback`), in [0, 1]. SparseLoCo (arXiv 2508.15706, Algorithm 1)
    replaces the outer Nesterov momentum by this decayed accumulator: set ``outer_momentum = 0`` and
    ``outer_lr = 1`` (plain averaged descent, theta <- theta - alpha * mean of the sparse deltas) with beta < 1
    (the paper uses 0.95); 1 keeps every unsent value undecayed (the previous behaviour)."""

    def __post_init__(self) -> None:
        def fail(field: str, requirement: str) -> None:
            raise ValueError(f"DiLoCoHyperparams.{field} must be {requirement}, got {getattr(self, field)!r}")

        for field in ("inner_steps", "warmup_steps", "lr_decay_steps", "fragments"):
            if not _is_int(getattr(self, field)):
                fail(field, "an int")
            object.__setattr__(self, field, int(getattr(self, field)))
        for field in ("inner_lr", "inner_weight_decay", "min_lr_ratio", "outer_lr", "outer_momentum",
                      "grad_clip_norm", "error_feedback_decay", "overlap_mix"):
            value = getattr(self, field)
            if not _is_real(value) or not math.isfinite(value):
                fail(field, "a finite number")
            object.__setattr__(self, field, float(value))
        betas = self.inner_betas
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(_is_real(b) and 0.0 <= b < 1.0 for b in betas)):
            fail("inner_betas", "a pair of numbers in [0, 1)")
        object.__setattr__(self, "inner_betas", (float(betas[0]), float(betas[1])))
        if not isinstance(self.outer_nesterov, bool):
            fail("outer_nesterov", "a bool")
        if self.overlap not in OVERLAPS:
            fail("overlap", f"one of {OVERLAPS}")
        if self.straggler not in STRAGGLERS:
            fail("straggler", f"one of {STRAGGLERS}")

        if self.inner_steps < 1:
            fail("inner_steps", ">= 1")
        if self.fragments < 1 or self.inner_steps % self.fragments:
            fail("fragments", f">= 1 and divide inner_steps ({self.inner_steps})")
        if self.inner_lr <= 0:
            fail("inner_lr", "> 0")
        if self.inner_weight_decay < 0:
            fail("inner_weight_decay", ">= 0")
        if self.warmup_steps < 0:
            fail("warmup_steps", ">= 0")
        if self.lr_decay_steps < 0:
            fail("lr_decay_steps", ">= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail("min_lr_ratio", "in [0, 1]")
        if self.outer_lr <= 0:
            fail("outer_lr", "> 0")
        if not 0.0 <= self.outer_momentum < 1.0:
            fail("outer_momentum", "in [0, 1)")
        if not 0.0 <= self.overlap_mix <= 1.0:
            fail("overlap_mix", "in [0, 1]")
        if not 0.0 <= self.error_feedback_decay <= 1.0:
            fail("error_feedback_decay", "in [0, 1]")
        if self.grad_clip_norm < 0:
            fail("grad_clip_norm", ">= 0 (0 disables clipping)")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DiLoCoHyperparams":
        """Build from a mapping (e.g. a TOML table); missing keys take defaults.

        Raises ``ValueError`` naming the first unknown key, or as the constructor does.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"unknown DiLoCo hyperparameter {key!r}; valid keys: {sorted(known)}")
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of all fields (``inner_betas`` as a list), accepted back by :meth:`from_dict`."""
        d = dataclasses.asdict(self)
        d["inner_betas"] = list(self.inner_betas)
        return d
