"""The pure core of a reducer: validating members' weights and aggregating one part in fp32 (weighted mean or
CenteredClip), whole or chunk by chunk. No I/O."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from protocols.codecs import all_finite
from protocols.matchmaking import Group
from protocols.robust import AGGREGATIONS, centered_clip


#: Largest weight (samples) a member may claim for one round.
MAX_WEIGHT = 1e12


# ---------------------------------------------------------------------------------------------------------- pure core


def validate_weight(weight: float) -> float:
    """A member's weight must be finite and in [0, MAX_WEIGHT]; returns it as float or raises ValueError."""
    weight = float(weight)
    if not math.isfinite(weight) or weight < 0 or weight > MAX_WEIGHT:
        raise ValueError(f"weight must be finite and in [0, {MAX_WEIGHT:g}], got {weight}")
    return weight


def prepare_local_input(group: Group, me: str, tensor: torch.Tensor, weight: float) -> tuple[torch.Tensor, float]:
    """Validate what this peer brings to a group's reduction: ``tensor`` (P,) fp32, ``weight`` (see
    :func:`validate_weight`) and its own membership. Returns ``(tensor, weight)``: the tensor detached, on the CPU,
    contiguous and checked finite once for the whole vector (chunks are then encoded without their own check), the
    weight as float. Raises ValueError."""
    weight = validate_weight(weight)
    if tensor.dtype != torch.float32 or tensor.dim() != 1:
        raise ValueError(f"tensor must be 1-D float32, got {tensor.dtype} {tuple(tensor.shape)}")
    if me not in group.members:
        raise ValueError("this peer is not a member of the group")
    tensor = tensor.detach().cpu().contiguous()
    if not all_finite(tensor):
        raise ValueError("cannot encode non-finite values")
    return tensor, weight


def prepare_out(out: Optional[torch.Tensor], tensor: torch.Tensor, sparse: bool) -> Optional[torch.Tensor]:
    """Check the buffer a caller hands an all-reduce for the average (``run(..., out=)``): None, or a contiguous
    fp32 CPU vector of ``tensor``'s length, which may be ``tensor`` itself (the average is then written over the
    input as the answers arrive: a part's values are read before its average can exist, since that average needs
    them). Not with a sparse codec: its sent parts are read back from the input after the exchange. Raises
    ValueError."""
    if out is None:
        return None
    if sparse:
        raise ValueError("out is not supported with a sparse codec (its sent parts are read from the input after "
                         "the exchange)")
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 1 or out.device.type != "cpu"
            or not out.is_contiguous() or out.numel() != tensor.numel()):
        shape = (out.dtype, tuple(out.shape), str(out.device)) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a contiguous fp32 CPU vector of {tensor.numel()} values, got {shape}")
    return out


def weight_problem(weight: object) -> Optional[str]:
    """None if a weight from a peer's header is acceptable (a number that passes :func:`validate_weight`), else the
    reason to exclude that peer."""
    if not isinstance(weight, (int, float)) or isinstance(weight, bool):
        return "weight is not a number"
    try:
        validate_weight(weight)
    except ValueError as e:
        return str(e)
    return None


class PartReducer:
    """Aggregates one part (numel,) from several senders, in fp32: the weighted mean, or CenteredClip.

    The mean is summed in arrival order; only the reducer computes it and everyone receives its encoded result, so
    the order does not need to agree across peers. ``centered_clip`` keeps every contribution (n x numel floats) and
    clips them around a robust center (:mod:`protocols.robust`) so that a minority of hostile senders cannot drag
    the result away.
    """

    def __init__(self, numel: int, aggregation: str = "mean", clip_tau: float = 1.0, clip_iterations: int = 20):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        self.numel = numel
        self.aggregation = aggregation
        self.clip_tau = clip_tau
        self.clip_iterations = clip_iterations
        self._sum = torch.zeros(numel, dtype=torch.float32)
        self._parts: list[tuple[torch.Tensor, float]] = []
        self.total_weight = 0.0
        self.contributors: list[str] = []

    def add(self, sender: str, part: torch.Tensor, weight: float) -> None:
        """Add ``weight * part``. Raises ValueError (and changes nothing) on a wrong shape, dtype, a non-finite value,
        a bad weight or a second contribution from the same sender."""
        weight = validate_weight(weight)
        if part.dtype != torch.float32 or part.shape != (self.numel,):
            raise ValueError(f"part must be float32 ({self.numel},), got {part.dtype} {tuple(part.shape)}")
        if not all_finite(part):
            raise ValueError("part has non-finite values")
        if sender in self.contributors:
            raise ValueError(f"{sender} already contributed")
        if self.aggregation == "mean":
            self._sum.add_(part, alpha=weight)
        else:
            self._parts.append((part, weight))
        self.total_weight += weight
        self.contributors.append(sender)

    def mean(self) -> torch.Tensor:
        """The aggregate (numel,): weighted mean or CenteredClip; zeros if the total weight is zero."""
        if self.total_weight <= 0:
            return torch.zeros(self.numel, dtype=torch.float32)
        if self.aggregation == "centered_clip":
            parts, weights = zip(*self._parts)
            return centered_clip(parts, weights, self.clip_tau, self.clip_iterations)
        return self._sum / self.total_weight


class ChunkedPartReducer:
    """Aggregates one part (numel,) from several senders chunk by chunk, in fp32 (see :class:`PartReducer`).

    ``bounds`` are the chunks' ``(start, stop)`` (:func:`protocols.partition.chunk_bounds`). A sender adds its chunks
    in order; chunk k's aggregate is available as soon as the caller decides chunk k is complete. With ``mean`` the
    aggregate of chunk k is the weighted mean over the senders that delivered chunk k (validation and exclusion are
    per chunk: a sender whose chunk k is invalid is left out of chunk k and every later one). ``centered_clip``
    clips whole parts (the robust center needs every coordinate): its aggregate uses the senders that delivered every
    chunk and is available once all chunks are complete.
    """

    def __init__(self, numel: int, bounds: Sequence[tuple[int, int]], aggregation: str = "mean",
                 clip_tau: float = 1.0, clip_iterations: int = 20):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        self.numel = numel
        self.bounds = list(bounds)
        self.aggregation = aggregation
        self.clip_tau = clip_tau
        self.clip_iterations = clip_iterations
        self._sum = torch.zeros(numel if aggregation == "mean" else 0, dtype=torch.float32)
        self._chunk_weight = [0.0] * len(self.bounds)
        self._aggregated = [False] * len(self.bounds)  # mean: chunk k of _sum now holds its aggregate
        self._parts: dict[str, torch.Tensor] = {}  # centered_clip: every sender's whole part
        self._weights: dict[str, float] = {}
        self.delivered: dict[str, int] = {}
        """Chunks each sender delivered (in order)."""
        self._clipped: Optional[torch.Tensor] = None

    @property
    def contributors(self) -> list[str]:
        """Senders that delivered every chunk, in arrival order of their first chunk."""
        return [s for s, n in self.delivered.items() if n == len(self.bounds)]

    @property
    def total_weight(self) -> float:
        return sum(self._weights[s] for s in self.contributors)

    def add(self, sender: str, k: int, chunk: torch.Tensor, weight: float, finite_checked: bool = False) -> None:
        """Add ``sender``'s chunk ``k`` (fp32, the chunk's length) with ``weight``. Raises ValueError (and changes
        nothing) on a wrong shape or dtype, a non-finite value (unless ``finite_checked``), a bad weight, a weight
        that differs from the sender's earlier chunks, or a chunk out of order."""
        weight = validate_weight(weight)
        start, stop = self.bounds[k]
        if chunk.dtype not in (torch.float32, torch.float16) or chunk.shape != (stop - start,):
            raise ValueError(f"chunk must be float32 or float16 ({stop - start},), got {chunk.dtype} "
                             f"{tuple(chunk.shape)}")
        if self.delivered.get(sender, 0) != k:
            raise ValueError(f"{sender} sent chunk {k} after {self.delivered.get(sender, 0)} chunks")
        if self._aggregated[k]:
            raise ValueError(f"chunk {k} was already aggregated")
        if self._weights.setdefault(sender, weight) != weight:
            raise ValueError(f"{sender} changed its weight mid-part")
        if not finite_checked and not all_finite(chunk):
            raise ValueError("chunk has non-finite values")
        if self.aggregation == "mean":
            self._sum[start:stop].add_(chunk, alpha=weight)  # fp16 is widened exactly inside the add
            self._chunk_weight[k] += weight
        else:
            part = self._parts.get(sender)
            if part is None:
                part = self._parts[sender] = torch.empty(self.numel, dtype=torch.float32)
            part[start:stop] = chunk
        self.delivered[sender] = k + 1

    def chunk_aggregate(self, k: int) -> torch.Tensor:
        """Chunk ``k``'s aggregate (its length,), fp32: the weighted mean of the senders that delivered it, or its
        slice of the CenteredClip of the complete parts; zeros if their total weight is zero. With ``mean`` the
        first call closes chunk k (later :meth:`add` calls for it raise ValueError) and divides its sum in place:
        the result is a view of this reducer's memory, the same on every call."""
        start, stop = self.bounds[k]
        if self.aggregation == "mean":
            chunk = self._sum[start:stop]
            if not self._aggregated[k]:  # in place: no buffer of its own, one pass less than a fresh quotient
                self._aggregated[k] = True
                weight = self._chunk_weight[k]
                if weight <= 0:
                    chunk.zero_()
                else:
                    chunk.div_(weight)
            return chunk
        if self._clipped is None:
            complete = [s for s in self.contributors if self._weights[s] > 0]
            if not complete:
                self._clipped = torch.zeros(self.numel, dtype=torch.float32)
            else:
                self._clipped = centered_clip([self._parts[s] for s in complete], [self._weights[s] for s in complete],
                                              self.clip_tau, self.clip_iterations)
        return self._clipped[start:stop]
