"""The outer side of DiLoCo: the outer state as a value (:class:`OuterState`), the outer step overlapped with the next
inner steps (:class:`DelayedOuterStep`) and the reference weighted average; no I/O."""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from protocols.codecs.base import all_finite
from protocols.diloco.hyperparams import DiLoCoHyperparams, _is_int, _is_real


# ---------------------------------------------------------------------------------------------------------------
# Outer state


def _check_vector(name: str, t: Any, numel: int | None = None, finite: bool = True) -> None:
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
    if finite and not all_finite(t):  # a sum's pass, no boolean copy: ~10x cheaper than isfinite().all()
        raise ValueError(f"{name} contains non-finite values")


#: Values per chunk of an outer step (:meth:`OuterState.apply`): 1 MiB of fp32 per vector, so a chunk's vectors stay
#: in the cache between its operations (a step over 125M values on 2 cores: 0.43 s, against 0.45 s at 4 MiB and 0.61 s
#: at 256 KiB).
_STEP_CHUNK = 1 << 18


def _writable_vector(t: torch.Tensor) -> bool:
    """A contiguous fp32 1-D CPU tensor (a buffer an outer step may write its result into)."""
    return t.dim() == 1 and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _partly_shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` live in one storage without being the same vector."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.data_ptr() != b.data_ptr()


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
    1-D CPU tensors of the same shape, or ``outer_round`` is not an int >= 0. ``checked``: the caller has already
    proved every value finite (e.g. :meth:`apply`, on its chunks), so the two passes over 8P bytes are skipped.
    """

    __slots__ = ("theta", "momentum", "outer_round", "_digest", "_digest_lock")

    def __init__(self, theta: torch.Tensor, momentum: torch.Tensor, outer_round: int, *,
                 checked: bool = False) -> None:
        _check_vector("theta", theta, finite=not checked)
        _check_vector("momentum", momentum, numel=theta.numel(), finite=not checked)
        if not _is_int(outer_round) or outer_round < 0:
            raise ValueError(f"outer_round must be an int >= 0, got {outer_round!r}")
        self.theta = theta.detach().contiguous()  # (P,)
        self.momentum = momentum.detach().contiguous()  # (P,)
        self.outer_round = int(outer_round)
        self._digest: str | None = None  # computed once: the state never changes
        self._digest_lock = threading.Lock()

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

    def pseudo_gradient(self, theta_local: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """DiLoCo's delta = theta_outer - theta_local, fp32 (P,); a descent direction like a gradient.

        ``theta_local`` (P,) may be of any float dtype or device (it is converted to fp32 CPU). ``in_place``: the
        caller hands ``theta_local`` over (an fp32 CPU vector of its own, e.g. a fresh
        :meth:`peerd.roles.fragments.Fragment.flatten`): delta is written into its buffer instead of a new one,
        4P bytes of host memory less at the round boundary. Raises ``ValueError`` if it is not a 1-D tensor of P
        elements, or ``in_place`` is asked of a tensor that is no contiguous fp32 CPU vector.
        """
        if not isinstance(theta_local, torch.Tensor) or theta_local.dim() != 1 or theta_local.numel() != self.numel:
            shape = tuple(theta_local.shape) if isinstance(theta_local, torch.Tensor) else type(theta_local).__name__
            raise ValueError(f"theta_local must have shape ({self.numel},), got {shape}")
        if not in_place:
            return self.theta - theta_local.detach().to("cpu", torch.float32)
        if not _writable_vector(theta_local):
            raise ValueError(f"in_place needs a contiguous fp32 CPU vector, got {theta_local.dtype} on "
                             f"{theta_local.device}")
        return torch.sub(self.theta, theta_local.detach(), out=theta_local.detach())

    def apply(self, avg_pseudo_gradient: torch.Tensor, hp: DiLoCoHyperparams,
              out: Optional[torch.Tensor] = None) -> "OuterState":
        """One outer step: a NEW state with SGD(lr=hp.outer_lr, momentum=hp.outer_momentum,
        nesterov=hp.outer_nesterov, dampening=0) applied to theta with gradient ``avg_pseudo_gradient``; round + 1.

        Same math as ``torch.optim.SGD``: ``buf = mu * buf + g``; ``step = g + mu * buf`` (Nesterov) else ``buf``;
        ``theta = theta - lr * step``. ``self`` is never modified, so rollback is keeping ``self``. ``out``: a
        contiguous fp32 (P,) CPU buffer the caller hands over (its pseudo-gradient, dead once averaged; it may be
        ``avg_pseudo_gradient`` itself) that becomes the new theta, instead of a fresh one: 4P bytes of host memory
        less at the round boundary. Used only where it is page-locked exactly when theta is (a GPU trains: the new
        theta goes to the device from page-locked memory); otherwise a fresh buffer is taken. Raises ``ValueError``
        (and changes nothing) if ``avg_pseudo_gradient`` is not a finite fp32 (P,) CPU tensor, and if the step
        overflows fp32 (``self`` unchanged; a handed-over ``out`` then holds part of the step).
        """
        g = avg_pseudo_gradient
        _check_vector("avg_pseudo_gradient", g, numel=self.numel)
        mu, lr, nesterov = hp.outer_momentum, hp.outer_lr, hp.outer_nesterov
        # The new theta lands in page-locked memory when the old one is there (a GPU trains): copying it to the
        # device at the round's end then runs at the bus's speed, not through a staging buffer. The momentum never
        # goes to the device and stays in ordinary (swappable) memory. The step is computed in theta's buffer (no
        # third vector of P values: each fresh one costs its page faults, ~0.1 s per 500 MB).
        pinned = self.theta.is_pinned()
        reuse = (out is not None and _writable_vector(out) and out.numel() == self.numel
                 and out.is_pinned() == pinned and not _partly_shared(out, g))
        step = out if reuse else _host_empty(self.numel, pinned)
        buf = torch.empty(self.numel, dtype=torch.float32)
        scratch = torch.empty(min(self.numel, _STEP_CHUNK), dtype=torch.float32)
        # Chunk by chunk, every operation of a chunk while it is in the cache: one pass over memory instead of one per
        # operation (with all_finite's torch sum, 1.38x faster on 125M-350M values: scripts/bench_outer_step.py). The
        # same operations on every value as one pass each, so the same bits: one multiply and one add per kernel, in
        # this order, never a fused add(alpha=...), which rounds once and whose use depends on the CPU's vector width
        # (bit-identity across peers). With ``step`` over ``g``, each chunk of ``g`` is read before it is overwritten.
        for start in range(0, self.numel, _STEP_CHUNK):
            chunk = slice(start, start + _STEP_CHUNK)
            g_c, buf_c, step_c = g[chunk], buf[chunk], step[chunk]
            torch.mul(self.momentum[chunk], mu, out=buf_c)
            buf_c.add_(g_c)
            if not nesterov:
                step_c.copy_(buf_c)
            elif step_c.data_ptr() == g_c.data_ptr():  # g + mu * buf: IEEE addition commutes, the same bits
                part = scratch[:buf_c.numel()]
                step_c.add_(torch.mul(buf_c, mu, out=part))
            else:
                torch.mul(buf_c, mu, out=step_c).add_(g_c)
            step_c.mul_(lr)
            torch.sub(self.theta[chunk], step_c, out=step_c)
            # checked while in the cache: a non-finite momentum value makes its theta value non-finite too (mu * inf
            # + g, times lr > 0, from theta), so theta's check covers both; the momentum is named where it overflowed
            if not all_finite(step_c):
                raise ValueError(f"{'theta' if all_finite(buf_c) else 'momentum'} contains non-finite values")
        return OuterState(step, buf, self.outer_round + 1, checked=True)

    def digest(self) -> str:
        """Hex sha256 of (outer_round as 8-byte little-endian, P as 8-byte LE, theta bytes, momentum bytes),
        tensors as little-endian fp32. Equal digests mean bit-identical states. Computed on the first call (8P bytes
        hashed: ~1.2 GB/s on one core, seconds for a billion parameters) and kept: the state is immutable. Thread
        safe: a call while another thread computes it waits for that result instead of hashing again."""
        if self._digest is not None:
            return self._digest
        with self._digest_lock:
            if self._digest is None:
                h = hashlib.sha256()
                h.update(self.outer_round.to_bytes(8, "little"))
                h.update(self.numel.to_bytes(8, "little"))
                for t in (self.theta, self.momentum):
                    h.update(memoryview(t.numpy().astype("<f4", copy=False)).cast("B"))
                self._digest = h.hexdigest()
        return self._digest

    @property
    def known_digest(self) -> Optional[str]:
        """:meth:`digest` if it was computed already, else None (never computes it)."""
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
