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
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

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


# ---------------------------------------------------------------------------------------------------------------
# Outer state


def _check_vector(name: str, t: Any, numel: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on CPU, got {t.device}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains non-finite values")


def _host_empty(numel: int, pinned: bool) -> torch.Tensor:
    """An uninitialised fp32 (numel,) CPU tensor, page-locked if ``pinned``."""
    return torch.empty(numel, dtype=torch.float32, pin_memory=pinned)


class OuterState:
    """Snapshot of DiLoCo's outer optimizer; a value, immutable by convention (never mutate its tensors).

    Attributes:
        theta: fp32 (P,) CPU, the outer parameters theta_outer.
        momentum: fp32 (P,) CPU, the outer SGD momentum buffer (zeros before the first outer step).
        outer_round: number of completed outer rounds (>= 0).

    The constructor takes ownership of the tensors (no copy). Raises ``ValueError`` if they are not finite fp32
    1-D CPU tensors of the same shape, or ``outer_round`` is not an int >= 0.
    """

    __slots__ = ("theta", "momentum", "outer_round", "_digest")

    def __init__(self, theta: torch.Tensor, momentum: torch.Tensor, outer_round: int) -> None:
        _check_vector("theta", theta)
        _check_vector("momentum", momentum, numel=theta.numel())
        if not _is_int(outer_round) or outer_round < 0:
            raise ValueError(f"outer_round must be an int >= 0, got {outer_round!r}")
        self.theta = theta.detach().contiguous()  # (P,)
        self.momentum = momentum.detach().contiguous()  # (P,)
        self.outer_round = int(outer_round)
        self._digest: str | None = None  # computed once: the state never changes

    @classmethod
    def initial(cls, theta: torch.Tensor) -> "OuterState":
        """Round 0 from a copy of ``theta`` (fp32 (P,)), momentum zeros."""
        if isinstance(theta, torch.Tensor):  # a page-locked theta (see Fragment.flatten) stays page-locked
            pinned = theta.is_pinned()
            theta = _host_empty(theta.numel(), pinned).view(theta.shape).copy_(theta.detach())
        _check_vector("theta", theta)
        return cls(theta, torch.zeros_like(theta), 0)

    @property
    def numel(self) -> int:
        """P, the number of parameters."""
        return self.theta.numel()

    def pseudo_gradient(self, theta_local: torch.Tensor) -> torch.Tensor:
        """DiLoCo's delta = theta_outer - theta_local, fp32 (P,); a descent direction like a gradient.

        ``theta_local`` (P,) may be of any float dtype or device (it is converted to fp32 CPU). Raises
        ``ValueError`` if it is not a 1-D tensor of P elements.
        """
        if not isinstance(theta_local, torch.Tensor) or theta_local.dim() != 1 or theta_local.numel() != self.numel:
            shape = tuple(theta_local.shape) if isinstance(theta_local, torch.Tensor) else type(theta_local).__name__
            raise ValueError(f"theta_local must have shape ({self.numel},), got {shape}")
        return self.theta - theta_local.detach().to("cpu", torch.float32)

    def apply(self, avg_pseudo_gradient: torch.Tensor, hp: DiLoCoHyperparams) -> "OuterState":
        """One outer step: a NEW state with SGD(lr=hp.outer_lr, momentum=hp.outer_momentum,
        nesterov=hp.outer_nesterov, dampening=0) applied to theta with gradient ``avg_pseudo_gradient``; round + 1.

        Same math as ``torch.optim.SGD``: ``buf = mu * buf + g``; ``step = g + mu * buf`` (Nesterov) else ``buf``;
        ``theta = theta - lr * step``. ``self`` is never modified, so rollback is keeping ``self``. Raises
        ``ValueError`` (and changes nothing) if ``avg_pseudo_gradient`` is not a finite fp32 (P,) CPU tensor.
        """
        g = avg_pseudo_gradient
        _check_vector("avg_pseudo_gradient", g, numel=self.numel)
        mu, lr = hp.outer_momentum, hp.outer_lr
        # One multiply and one add per kernel, in this order, never a fused add(alpha=...): a fused multiply-add
        # rounds once and its use depends on the CPU's vector width, which would break bit-identity across peers.
        buf = self.momentum * mu
        buf.add_(g)
        if hp.outer_nesterov:
            step = buf * mu
            step.add_(g)
        else:
            step = buf.clone()
        step.mul_(lr)
        # The new theta lands in page-locked memory when the old one is there (a GPU trains): copying it to the
        # device at the round's end then runs at the bus's speed, not through a staging buffer. The momentum never
        # goes to the device and stays in ordinary (swappable) memory.
        theta = torch.sub(self.theta, step, out=_host_empty(self.numel, self.theta.is_pinned()))
        return OuterState(theta, buf, self.outer_round + 1)

    def digest(self) -> str:
        """Hex sha256 of (outer_round as 8-byte little-endian, P as 8-byte LE, theta bytes, momentum bytes),
        tensors as little-endian fp32. Equal digests mean bit-identical states. Computed on the first call (8P bytes
        hashed: seconds for a billion parameters) and kept: the state is immutable."""
        if self._digest is not None:
            return self._digest
        h = hashlib.sha256()
        h.update(self.outer_round.to_bytes(8, "little"))
        h.update(self.numel.to_bytes(8, "little"))
        for t in (self.theta, self.momentum):
            h.update(memoryview(t.numpy().astype("<f4", copy=False)).cast("B"))
        self._digest = h.hexdigest()
        return self._digest

    def state_dict(self) -> dict[str, Any]:
        """``{"theta": Tensor (P,), "momentum": Tensor (P,), "outer_round": int}``; the tensors are this state's own
        (no copy): do not modify them."""
        return {"theta": self.theta, "momentum": self.momentum, "outer_round": self.outer_round}

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any], numel: int | None = None) -> "OuterState":
        """Rebuild from :meth:`state_dict` output (e.g. a checkpoint or a peer's state transfer), copying tensors.

        ``numel``: the expected P (the local model's size), checked if given. Raises ``ValueError`` on a non-mapping,
        a missing or unknown key, a wrong dtype or shape, a shape other than (numel,), non-finite values, or an
        invalid ``outer_round``.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"outer state must be a mapping, got {type(d).__name__}")
        expected = {"theta", "momentum", "outer_round"}
        missing, unknown = expected - set(d), set(d) - expected
        if missing:
            raise ValueError(f"outer state is missing key(s) {sorted(missing)}")
        if unknown:
            raise ValueError(f"outer state has unknown key(s) {sorted(unknown, key=str)}")
        if numel is not None and (not _is_int(numel) or numel < 0):
            raise ValueError(f"numel must be an int >= 0, got {numel!r}")
        tensors = {}
        for name in ("theta", "momentum"):
            t = d[name]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"outer state {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.float32:
                raise ValueError(f"outer state {name} must be float32, got {t.dtype}")
            tensors[name] = t.detach().to("cpu", copy=True).contiguous()
            _check_vector(f"outer state {name}", tensors[name], numel=numel)
        if tensors["theta"].shape != tensors["momentum"].shape:
            raise ValueError(f"outer state theta {tuple(tensors['theta'].shape)} and momentum "
                             f"{tuple(tensors['momentum'].shape)} differ in shape")
        return cls(tensors["theta"], tensors["momentum"], d["outer_round"])

    def __repr__(self) -> str:
        return f"OuterState(outer_round={self.outer_round}, numel={self.numel}, digest={self.digest()[:12]})"


# ---------------------------------------------------------------------------------------------------------------
# Overlapped outer rounds


@dataclass(frozen=True)
class DelayedOuterStep:
    """The outer step overlapped with the next round's inner steps, so that compute never waits for the all-reduce.

    Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512, sec. 2.3, "overlapping communication"):

    1. end of round r's inner steps: the worker sends ``delta_r = theta_outer - theta_local`` (:meth:`boundary`) to
       a background all-reduce and keeps training from theta_local (no restart: the steps taken during the exchange
       are not thrown away);
    2. as soon as the average ``A_r`` arrives, tau inner steps later (tau: how many steps the exchange took):
       ``theta_outer <- OuterOpt(theta_outer, A_r)`` (:meth:`complete`) and ``theta_local <- alpha * theta_local +
       (1 - alpha) * theta_outer`` (:meth:`merge`; alpha = ``DiLoCoHyperparams.overlap_mix``, 0.5 by default as in
       the paper);
    3. round r+1's pseudo-gradient is taken against that new theta_outer at its own end.

    Every peer applies the same averages to the same theta_outer, so theta_outer stays bit-identical across peers
    exactly as with ``overlap = "none"``; only theta_local (never shared) depends on when the average arrived.
    A background all-reduce that failed (``complete(None)``) leaves theta_outer, momentum and ``outer_round``
    unchanged and theta_local unmerged: the next round's ``delta = theta_outer - theta_local`` then covers every
    local step since the last outer step, so no step is lost (weight it by all their samples).

    Kale et al. 2025 ("Eager updates", arXiv 2502.12996) compare this with two alternatives: restarting round r+1
    from theta_outer and applying ``A_r`` one full round late (their naive delayed step: each applied average was
    taken against a state one outer step older; on the WAN benchmark its eval loss rose from round to round), and
    *eager* updates, which replace the worker's own stale term by its fresh local pseudo-gradient; eager makes
    theta_outer differ per worker, which breaks the bit-identical outer state peerd relies on (state transfer,
    digests, checkpoint equality), so it is not implemented.

    A value, as :class:`OuterState`: :meth:`complete` returns a new object.

    Attributes:
        state: the outer state with every finished average applied (fp32 (P,) theta and momentum).
    """

    state: OuterState

    def boundary(self, theta_local: torch.Tensor) -> torch.Tensor:
        """End of a round's inner steps: ``delta = self.state.theta - theta_local`` (fp32 (P,)), the pseudo-gradient
        to send to the background all-reduce. Raises ValueError on a wrong shape (:meth:`OuterState.pseudo_gradient`).
        """
        return self.state.pseudo_gradient(theta_local)

    def complete(self, finished_average: torch.Tensor | None, hp: DiLoCoHyperparams) -> "DelayedOuterStep":
        """Apply a finished background average ``A_r`` (fp32 (P,)); None (it failed) leaves everything unchanged.
        Raises ValueError (nothing applied) as :meth:`OuterState.apply`."""
        if finished_average is None:
            return self
        return DelayedOuterStep(self.state.apply(finished_average, hp))

    def merge(self, theta_local: torch.Tensor, hp: DiLoCoHyperparams) -> torch.Tensor:
        """``alpha * theta_local + (1 - alpha) * theta_outer`` (fp32 (P,) CPU), alpha = ``hp.overlap_mix``: where
        the inner steps go on after :meth:`complete`. Raises ValueError on a wrong shape."""
        local = theta_local.detach().to("cpu", torch.float32)
        if local.dim() != 1 or local.numel() != self.state.numel:
            raise ValueError(f"theta_local must have shape ({self.state.numel},), got {tuple(local.shape)}")
        alpha = hp.overlap_mix
        return local.mul(alpha).add_(self.state.theta.mul(1.0 - alpha))


# ---------------------------------------------------------------------------------------------------------------
# Reference averaging


def weighted_average(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Reference ``sum(w_i * x_i) / sum(w_i)`` in fp32, summed in list order; same shape as the inputs.

    Weights are typically sample counts. Tensors with weight 0 are skipped. Raises ``ValueError`` if the lengths
    differ or are 0, the shapes differ, or a weight is negative or non-finite, or all weights are 0.
    """
    if len(tensors) != len(weights):
        raise ValueError(f"got {len(tensors)} tensors but {len(weights)} weights")
    if len(tensors) == 0:
        raise ValueError("weighted_average needs at least one tensor")
    for w in weights:
        if not _is_real(w) or not math.isfinite(w) or w < 0:
            raise ValueError(f"weights must be finite and >= 0, got {w!r}")
    total = float(sum(float(w) for w in weights))
    if total <= 0:
        raise ValueError("weights are all zero")
    shape = tensors[0].shape
    acc = torch.zeros(shape, dtype=torch.float32)
    for x, w in zip(tensors, weights):
        if x.shape != shape:
            raise ValueError(f"tensor shapes differ: {tuple(shape)} vs {tuple(x.shape)}")
        if w != 0:
            acc.add_(x.detach().to("cpu", torch.float32) * float(w))
    return acc.div_(total)
