"""SkipPipe's decisions, pure (no I/O): which stages each micro-batch skips, and which server runs each visit when.

Source: SkipPipe (Blagoev et al. 2025, arXiv 2502.19913; reference code gensyn-ai/skippipe). A micro-batch's
*path* visits the first and the last stage and skips some middle stages, in increasing stage order; a skipped stage
passes the activations through unchanged (residual identity), so gradients flow through the visited stages only.
The reference builds its schedule offline for a fixed cluster (conflict-based search + A*); here both decisions are
recomputed live from the servers a trainer sees and their measured throughputs.

Path choice (:func:`generate_paths`): every path skips ``skips_per_path(S, k)`` middle stages (stage fraction
<= k). How often each middle stage is skipped is decided first: in proportion to its time per sample (slow
stages are skipped more), capped so that every middle stage is still visited by at least ``min_share`` of the
micro-batches (the paper's convergence constraint: every stage keeps being trained). Those counts are then dealt
to the micro-batches greedily, the stages with the most skips left first (the Gale-Ryser construction of a 0/1
matrix with given row and column sums: it always succeeds when the counts are feasible), ties broken by a seeded
draw. Deterministic for a seed.

Scheduling (:func:`schedule`): list scheduling with earliest finish time (HEFT-style, Topcuoglu et al. 2002) in
place of CBS + A*. Visits are booked in the order they become ready (forward along the path, the loss at the last
stage, backward in reverse on the *same* servers, which keep the inputs); a forward or loss visit goes to the
server of its stage that would finish it first, given its busy intervals (a visit may fill an earlier idle gap).
By construction a server never holds two visits at once, a slower server gets fewer visits, and rescheduling after
a server leaves is the same call without it. :func:`best_assignment_schedule` (exhaustive, small instances only)
gives the best makespan over every server assignment, for comparing the greedy rule against it.

Units: a server's ``seconds`` is its forward time for one micro-batch; backward takes ``backward_factor`` times it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

__all__ = [
    "Booking", "NoPath", "Schedule", "SkipPlanner", "best_assignment_schedule", "default_min_share", "generate_paths",
    "schedule", "skip_counts", "skips_per_path",
]

Path = tuple[int, ...]


class NoPath(ValueError):
    """No path exists: the first or the last stage has no server (they can never be skipped)."""


def skips_per_path(num_stages: int, skip_ratio: float) -> int:
    """Middle stages each path skips: ``floor(k * S)``, at most ``S - 3`` (one middle stage is always visited, so
    no middle stage goes untrained). Raises ValueError unless ``0 <= k < 1`` and ``S >= 1``."""
    if not 0 <= skip_ratio < 1:
        raise ValueError(f"skip_ratio must be in [0, 1), got {skip_ratio}")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    return max(0, min(math.floor(skip_ratio * num_stages + 1e-9), num_stages - 3))


def default_min_share(num_stages: int, skip_ratio: float) -> float:
    """Least share of micro-batches every middle stage is visited by: half its share with skips spread evenly,
    ``(1 - s / m) / 2`` for ``s`` skips per path over ``m`` middle stages (1 without skips)."""
    s, m = skips_per_path(num_stages, skip_ratio), num_stages - 2
    return 1.0 if s == 0 else (1 - s / m) / 2


def skip_counts(total: int, weights: Sequence[float], cap: int) -> list[int]:
    """Split ``total`` skips among stages in proportion to ``weights`` (> 0), none above ``cap``.

    Water-filling: a stage whose share exceeds the cap gets the cap, the rest is split again among the others;
    rounding by largest remainder. Raises ValueError if ``total > cap * len(weights)``.
    """
    n = len(weights)
    if total > cap * n:
        raise ValueError(f"{total} skips cannot fit {n} stages of at most {cap}")
    counts = [0.0] * n
    free = set(range(n))
    left = float(total)
    while free and left > 1e-9:
        weight = sum(weights[j] for j in free)
        over = [j for j in free if left * weights[j] / weight > cap]
        if not over:
            for j in free:
                counts[j] = left * weights[j] / weight
            break
        for j in over:
            counts[j] = cap
            left -= cap
            free.discard(j)
    whole = [min(cap, math.floor(c + 1e-9)) for c in counts]
    order = sorted(range(n), key=lambda j: (-(counts[j] - whole[j]), j))
    for j in order:
        if sum(whole) >= total:
            break
        if whole[j] < cap:
            whole[j] += 1
    for j in range(n):  # rounding left some short (every other stage at its cap): fill any room left
        while sum(whole) < total and whole[j] < cap:
            whole[j] += 1
    return whole


def generate_paths(num_stages: int, skip_ratio: float, count: int, *,
                   seconds: Optional[Mapping[int, float]] = None, available: Optional[Iterable[int]] = None,
                   min_share: Optional[float] = None, seed: int | str = 0) -> list[Path]:
    """Paths of ``count`` micro-batches through ``num_stages`` stages (see the module docstring).

    Args:
        num_stages: S.
        skip_ratio: k in [0, 1): a path skips at most ``floor(k * S)`` stages (see :func:`skips_per_path`).
        count: micro-batches to plan (e.g. one outer window).
        seconds: a middle stage's time per sample (1 / its throughput); stages with more are skipped more. Missing
            stages count as the median of the given ones (1.0 if none is given).
        available: stages that have a server (None: all). A middle stage without one is skipped by every path (on
            top of the k budget: it cannot be visited); the first and the last stage must be available.
        min_share: least share of the micro-batches each available middle stage is visited by (None:
            :func:`default_min_share`); more than ``1 - s / m`` is infeasible.
        seed: tie-breaks (equal stages take turns in a seeded order).

    Returns:
        ``count`` tuples of increasing stage indices, each starting at 0 and ending at S - 1.

    Raises:
        NoPath: the first or the last stage is not available.
        ValueError: bad ``skip_ratio``, ``count`` < 0 or an infeasible ``min_share``.
    """
    s = skips_per_path(num_stages, skip_ratio)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    avail = set(range(num_stages)) if available is None else set(available)
    if 0 not in avail or num_stages - 1 not in avail:
        raise NoPath(f"stage {0 if 0 not in avail else num_stages - 1} has no server: no path through the pipeline")
    middle = [j for j in range(1, num_stages - 1) if j in avail]
    if num_stages == 1:
        return [(0,)] * count
    # the k budget counts stages skipped for lack of a server too, and at least one middle stage stays visited
    missing = (num_stages - 2) - len(middle)
    s_free = max(0, min(s - missing, len(middle) - 1))
    share = default_min_share(num_stages, skip_ratio) if min_share is None else min_share
    if not 0 <= share <= 1:
        raise ValueError(f"min_share must be in [0, 1], got {share}")
    cap = count - math.ceil(share * count - 1e-9)  # most micro-batches that may skip one stage
    if s_free and s_free * count > cap * len(middle):
        raise ValueError(f"min_share {share} leaves room for {cap * len(middle)} skips, {s_free * count} needed")
    known = sorted(v for j, v in (seconds or {}).items() if j in middle and v > 0)
    fallback = known[len(known) // 2] if known else 1.0
    weights = [seconds[j] if seconds and seconds.get(j, 0) > 0 else fallback for j in middle]
    left = skip_counts(s_free * count, weights, cap) if s_free else [0] * len(middle)
    rng = random.Random(f"skippipe-paths:{seed}")
    total = list(left)
    paths = []
    for _ in range(count):
        ties = {j: rng.random() for j in range(len(middle))}
        # the stage with the largest share of its skips still to go is skipped next: skips interleave through the
        # window in proportion, so a plan cut short (a server joined or was banned) keeps the planned ratio
        skipped = sorted(range(len(middle)),
                         key=lambda j: (-(left[j] / total[j] if total[j] else -1.0), ties[j]))[:s_free]
        for j in skipped:
            left[j] -= 1
        visit = [middle[j] for j in range(len(middle)) if j not in skipped]
        paths.append((0, *visit, num_stages - 1))
    return paths


# ------------------------------------------------------------------------------------------------------ scheduling


@dataclass(frozen=True)
class Booking:
    """One visit of a micro-batch to a server: ``phase`` is ``"forward"``, ``"loss"`` (last stage: forward and
    backward at once) or ``"backward"``; ``start`` / ``end`` in seconds from the schedule's start."""

    mb: int
    stage: int
    server: str
    phase: str
    start: float
    end: float


@dataclass(frozen=True)
class Schedule:
    """Every visit of every micro-batch, booked; ``makespan``: when the last one ends, in seconds."""

    bookings: tuple[Booking, ...]
    makespan: float

    def server_of(self, mb: int) -> dict[int, str]:
        """Stage -> server of micro-batch ``mb``'s visits."""
        return {b.stage: b.server for b in self.bookings if b.mb == mb}

    def visits_by_server(self) -> dict[str, int]:
        """Server -> micro-batches it runs (a forward + backward counts once)."""
        out: dict[str, int] = {}
        for b in self.bookings:
            if b.phase != "backward":
                out[b.server] = out.get(b.server, 0) + 1
        return out


class _Timeline:
    """A server's busy intervals, sorted; finds the earliest idle gap that fits."""

    def __init__(self) -> None:
        self.busy: list[tuple[float, float]] = []

    def earliest(self, ready: float, duration: float) -> float:
        start = ready
        for a, b in self.busy:
            if start + duration <= a + 1e-12:
                return start
            start = max(start, b)
        return start

    def book(self, start: float, duration: float) -> None:
        self.busy.append((start, start + duration))
        self.busy.sort()


def _simulate(paths: Sequence[Path], servers: Mapping[int, Mapping[str, float]], backward_factor: float,
              assign: Optional[Mapping[tuple[int, int], str]]) -> Schedule:
    last = max((p[-1] for p in paths), default=0)
    lines = {srv: _Timeline() for by in servers.values() for srv in by}
    bookings: list[Booking] = []
    chosen: dict[tuple[int, int], str] = {}
    # (ready time, micro-batch, position on its path, going back?): earlier-ready visits are booked first
    ready = [(0.0, mb, 0, False) for mb in range(len(paths))]
    heapq.heapify(ready)
    while ready:
        t, mb, pos, back = heapq.heappop(ready)
        stage = paths[mb][pos]
        if back:
            server = chosen[(mb, stage)]
            duration = backward_factor * servers[stage][server]
            start = lines[server].earliest(t, duration)
            phase = "backward"
        else:
            phase = "loss" if stage == last else "forward"
            factor = 1 + backward_factor if phase == "loss" else 1.0
            if not servers.get(stage):
                raise NoPath(f"stage {stage} has no server")
            options = [assign[(mb, stage)]] if assign is not None else sorted(servers[stage])
            best = None
            for srv in options:
                d = factor * servers[stage][srv]
                s0 = lines[srv].earliest(t, d)
                if best is None or s0 + d < best[0] + best[2] - 1e-12:
                    best = (s0, srv, d)
            start, server, duration = best
            chosen[(mb, stage)] = server
        lines[server].book(start, duration)
        bookings.append(Booking(mb, stage, server, phase, start, start + duration))
        end = start + duration
        if phase == "forward":
            heapq.heappush(ready, (end, mb, pos + 1, False))
        elif pos > 0:  # the loss or a backward: the gradient goes to the previous visited stage
            heapq.heappush(ready, (end, mb, pos - 1, True))
    return Schedule(tuple(bookings), max((b.end for b in bookings), default=0.0))


def schedule(paths: Sequence[Path], servers: Mapping[int, Mapping[str, float]],
             backward_factor: float = 2.0, assignment: Optional[Mapping[tuple[int, int], str]] = None) -> Schedule:
    """Book every visit of ``paths`` on a server of its stage (see the module docstring).

    Args:
        paths: micro-batch paths (e.g. from :func:`generate_paths`); micro-batch ids are their indices.
        servers: stage -> {server: seconds of one forward of one micro-batch}; stages no path visits may be absent.
        backward_factor: backward time / forward time (2 for a transformer block).
        assignment: (micro-batch, stage) -> server, to time a fixed assignment instead of choosing (baselines).

    Returns:
        A :class:`Schedule` in which no server holds two visits at once and every backward runs on the server of
        its forward. Raises :class:`NoPath` if a visited stage has no server.
    """
    return _simulate(paths, servers, backward_factor, assignment)


def best_assignment_schedule(paths: Sequence[Path], servers: Mapping[int, Mapping[str, float]],
                             backward_factor: float = 2.0, max_assignments: int = 1 << 16) -> Schedule:
    """The schedule with the smallest makespan over every assignment of visits to servers (each assignment timed
    as :func:`schedule` times it): a reference for small instances. Raises ValueError beyond ``max_assignments``."""
    visits = [(mb, stage) for mb, p in enumerate(paths) for stage in p]
    choices = [sorted(servers[stage]) for _, stage in visits]
    total = math.prod(len(c) for c in choices)
    if total > max_assignments:
        raise ValueError(f"{total} assignments exceed max_assignments={max_assignments}")
    best: Optional[Schedule] = None
    for combo in itertools.product(*choices):
        got = _simulate(paths, servers, backward_factor, dict(zip(visits, combo)))
        if best is None or got.makespan < best.makespan - 1e-12:
            best = got
    assert best is not None
    return best


# ------------------------------------------------------------------------------------------------- a live planner


class SkipPlanner:
    """A trainer's live SkipPipe plan: a path and a server per visited stage for each of its micro-batches.

    Plans ``window`` micro-batches at a time from what the trainer's wiring knows now (each stage's usable servers,
    i.e. announced and not banned, and their measured throughputs): :func:`generate_paths` then :func:`schedule`.
    The plan is recomputed when it is used up or as soon as the usable servers change (a server joined, left or
    was banned after a failure); slowdowns enter with the next window through the throughputs.

    Args:
        num_stages: S; skip_ratio: k in [0, 1); window: micro-batches planned at once (> 0).
        min_share: see :func:`generate_paths`; seed: of the tie-breaks (each window draws anew from it).
        backward_factor: backward / forward time, for the schedule.
    """

    def __init__(self, num_stages: int, skip_ratio: float, *, window: int = 16, min_share: Optional[float] = None,
                 seed: int | str = 0, backward_factor: float = 2.0) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        skips_per_path(num_stages, skip_ratio)  # validates
        self.num_stages, self.skip_ratio, self.window = num_stages, skip_ratio, window
        self.min_share, self.seed, self.backward_factor = min_share, seed, backward_factor
        self.plans = 0
        self._queue: list[tuple[Path, dict[int, str]]] = []
        self._view: Optional[frozenset] = None

    @staticmethod
    def view(wiring) -> dict[int, dict[str, float]]:
        """Stage -> {usable server: seconds per sample} from a :class:`protocols.swarm.Wiring` (an unmeasured
        server counts as the median measured one, or 1 s if none is measured)."""
        usable = {k: [s for s in b.servers if not b.bans.is_banned(s)] for k, b in enumerate(wiring.stages)}
        measured = sorted(1 / t for k, b in enumerate(wiring.stages) for s in usable[k]
                          if (t := b.throughput(s)))
        fallback = measured[len(measured) // 2] if measured else 1.0
        return {k: {s: (1 / t if (t := wiring.stages[k].throughput(s)) else fallback) for s in servers}
                for k, servers in usable.items() if servers}

    def next(self, wiring) -> tuple[Path, dict[int, str]]:
        """The next micro-batch's path and stage -> server. Raises :class:`NoPath` while the first or the last
        stage has no usable server."""
        view = self.view(wiring)
        key = frozenset((k, s) for k, servers in view.items() for s in servers)
        if not self._queue or key != self._view:
            seconds = {k: 1 / sum(1 / v for v in servers.values()) for k, servers in view.items()}
            paths = generate_paths(self.num_stages, self.skip_ratio, self.window, seconds=seconds, available=view,
                                   min_share=self.min_share, seed=f"{self.seed}:{self.plans}")
            plan = schedule(paths, view, self.backward_factor)
            self._queue = [(p, plan.server_of(i)) for i, p in enumerate(paths)]
            self._view = key
            self.plans += 1
        return self._queue.pop(0)
