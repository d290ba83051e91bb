"""DiLoCo: the pure core of one worker's inner/outer optimization (no I/O, no asyncio).

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models", arXiv 2311.08105.
Each worker runs H inner steps of AdamW from the shared outer parameters theta_outer, then sends its
pseudo-gradient ``delta = theta_outer - theta_local``; the workers average their deltas (weighted by samples) and
every worker applies the same outer SGD step with Nesterov momentum to theta_outer. Paper defaults: inner AdamW
lr 4e-4, weight decay 0.1, betas (0.9, 0.95), 1000 warm-up steps, H = 500; outer lr 0.7, momentum 0.9, Nesterov.

The outer state is a value (:class:`OuterState`): :meth:`OuterState.apply` returns a new state and never mutates
the old one, so a round that fails after averaging is rolled back by keeping the old object, and every peer that
applies the same averaged pseudo-gradient to the same state obtains bit-identical bytes (see
:meth:`OuterState.digest`).

The package: :mod:`~protocols.diloco.hyperparams` (:class:`DiLoCoHyperparams`), :mod:`~protocols.diloco.inner`
(the inner AdamW, its learning-rate schedule and the flat parameter vectors) and :mod:`~protocols.diloco.outer` (the
outer state, the overlapped outer step and the reference average).
"""

from protocols.diloco.hyperparams import OVERLAPS, STRAGGLERS, DiLoCoHyperparams
from protocols.diloco.inner import flatten_parameters, inner_lr_at, load_flat_parameters_, make_inner_optimizer, set_lr
from protocols.diloco.outer import DelayedOuterStep, OuterState, weighted_average

__all__ = [
    "OVERLAPS",
    "STRAGGLERS",
    "DelayedOuterStep",
    "DiLoCoHyperparams",
    "OuterState",
    "flatten_parameters",
    "inner_lr_at",
    "load_flat_parameters_",
    "make_inner_optimizer",
    "set_lr",
    "weighted_average",
]
