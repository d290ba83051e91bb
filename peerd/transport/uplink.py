"""This peer's uplink shared out between its connections: each paced by the kernel at its share of the link.

The butterfly all-reduce sends to every member of its group at once. Unpaced, those connections take turns
overfilling the bottleneck's queue, lose packets and back off; paced at their shares of the uplink they do not
(``scripts/bench_allreduce.py``, 4 peers at 100 Mbit/s: 0.89-0.92 of the link against 0.76-0.79 unpaced;
docs/benchmarks.md). The rate comes from the operator (``uplink_mb_s``, or the upload cap ``upload_limit_mb_s``)
where declared; otherwise :class:`UplinkMeter` measures it from the bytes that reached the receivers during the
previous all-reduces while the path held the sending back: the rate that got through the path's bottleneck (not
the rate bytes were handed to the kernel at, which a socket buffer inflates, nor that of a sender slower than its
link). Paced at 0.9 of the link, 4 peers moved 0.87 of it; at 1.1, 0.87; at 1.3, 0.83;
at 1.6, 0.82: the pace wants the link's rate within ~10%, and is worth something even well above it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping, Optional

logger = logging.getLogger(__name__)

#: ``pace(peer_id, bytes_per_s or None) -> bool``: :meth:`peerd.transport.direct.DirectStreams.pace`.
PaceFn = Callable[[str, Optional[float]], bool]
#: ``counters(peer_id) -> {connection key: counters}``, each with ``segments_delivered``, ``segment_bytes`` and
#: ``path_limited_s``:
#: :meth:`peerd.transport.direct.DirectStreams.send_counters` (:class:`peerd.transport.connection.SendCounters`).
CountersFn = Callable[[str], Mapping[Hashable, Any]]


@dataclass
class _PathBound:
    """One connection's samples in which the path held its sending back, summed over a stretch."""

    seconds: float = 0.0
    delivered: float = 0.0
    """Bytes that reached the receiver in those samples."""
    paced: float = 0.0
    """Bytes its pace allowed in those samples (pace x seconds)."""

    def add(self, seconds: float, delivered: float, pace: float) -> None:
        self.seconds += seconds
        self.delivered += delivered
        self.paced += pace * seconds


class UplinkMeter:
    """The uplink's rate (bytes/s), measured from what reached the receivers while all-reduces were sending.

    Between :meth:`begin` and :meth:`end` (one or more all-reduces at once), :meth:`sample` is called every
    ``sample_s``: it sums the bytes delivered on the connections to the peers sent to (segments the receivers
    acknowledged or selectively acknowledged, :class:`peerd.transport.connection.SendCounters`). A ``window_s`` counts
    only where the path held the sending back for at least ``path_bound`` of it (on some connection: bytes waiting
    for the congestion window or the pace, not for the receiver's window, and not a sender whose bytes leave as fast
    as it writes them, as on loopback or any link faster than the processors); the highest rate over such a window
    is the stretch's peak. :meth:`rate` is the median of the last ``history`` peaks (the lower one of two), so one
    stretch that read high or low is not paced at (on a 12.5 MB/s link, 4 peers' stretches read 11.8-12.7 MB/s, 8
    peers' 11.5-13.7: acknowledgements queued behind the receivers' own uploads arrive together). Two floors keep
    it from following a stretch its own pace held down, each judged over the whole stretch (every ``sample_s``
    a connection was path-bound for ``path_bound`` of it, at least ``window_s`` in all), not over a window: one
    connection's acknowledgements bunch enough that, of 7 connections paced 10% above what the path carried, some
    read at their pace over some window in most stretches, and the floors then held 8 peers' paces 8-18% above
    their links (8 peers at 100 Mbit/s, fp16: 0.82-0.85 of the link, against 0.88 with the floors judged over the
    stretch; docs/benchmarks.md, "The uplink meter's floors ...", 2026-11-29).
    Where some connection moved at ``reach`` of its pace (its pace bound it, not our uplink: what the others moved
    is what their receivers allowed), the rate is at least that stretch's pace: a 100 Mbit/s peer grouped with two
    behind 20 Mbit/s downloads read 10.7 MB/s unpaced, then 4-6 paced at shares of that, and fell every round
    without this floor. Where the connections together moved at ``reach`` of their paces, the rate is at least
    ``gain`` x that stretch's pace, so a measurement that started low (a round whose receivers were the slower side)
    climbs 5% a round until the path holds it back; on a steady link the pace then stays within ``1 / reach`` of
    the link's rate. None while nothing is measured, or where the rate is above ``max_rate`` (1 Gbit/s by default:
    there the processors bound an all-reduce, and pacing buys nothing): then nothing is paced. The kernel paces TCP
    payload, which is also what is counted: the rate is in payload bytes, 2-4% under the link's rate in packets.
    """

    def __init__(self, counters: CountersFn, window_s: float = 0.5, sample_s: float = 0.05, history: int = 3,
                 gain: float = 1.05, reach: float = 0.98, path_bound: float = 0.8, max_rate: float = 125e6,
                 clock: Callable[[], float] = time.monotonic):
        if not (window_s > 0 and sample_s > 0 and history >= 1 and gain >= 1 and 0 < reach <= 1
                and 0 <= path_bound <= 1 and max_rate > 0):
            raise ValueError("UplinkMeter needs window_s > 0, sample_s > 0, history >= 1, gain >= 1, "
                             "0 < reach <= 1, 0 <= path_bound <= 1, max_rate > 0")
        self.window_s, self.sample_s, self.gain, self.reach, self.max_rate = window_s, sample_s, gain, reach, max_rate
        self.path_bound = path_bound
        self._counters = counters
        self._clock = clock
        self.peaks: collections.deque[float] = collections.deque(maxlen=history)
        """The peaks (bytes/s) of the last stretches that measured one, oldest first."""
        self.path_limited = 0.0
        """The highest share of a window the path held the sending back for, in the last stretch (0-1)."""
        self._climb: Optional[float] = None  # gain x the pace of the last stretch, where that pace bound it
        self._hold: Optional[float] = None  # the pace of the last stretch, where it bound some connection
        self.begin()

    def begin(self, paced_at: Optional[float] = None) -> None:
        """A stretch of sending starts, its connections paced at shares of ``paced_at`` bytes/s (None: unpaced):
        counting starts afresh."""
        self._paced_at = paced_at
        self._last: dict[Hashable, Any] = {}  # key -> counters read last
        self._delivered: dict[str, int] = {}  # peer -> bytes delivered since its connections were first seen
        self._path_s: dict[Hashable, float] = {}  # key -> path-limited seconds since first seen
        self._window: collections.deque[tuple[float, dict[str, int], dict[Hashable, float]]] = collections.deque()
        self._peak = 0.0
        self._path_limited = 0.0
        self._sampled_at: Optional[float] = None
        self._bound: dict[str, _PathBound] = {}  # peer -> its samples that were path-bound, summed

    def sample(self, paces: Mapping[str, Optional[float]]) -> None:
        """Read the counters of the connections to the peers of ``paces`` (PeerID -> the rate in bytes/s its
        connections are paced at now; None: unpaced); a connection first seen now (or whose count went back: a new
        connection under a key reused) only sets its starting point."""
        now = self._clock()
        dt = now - self._sampled_at if self._sampled_at is not None else 0.0
        self._sampled_at = now
        for peer, pace in paces.items():
            moved = bound_s = 0.0  # this sample's bytes delivered; path-bound seconds of its most held connection
            for key, now_counters in self._counters(peer).items():
                before = self._last.get(key)
                if before is not None and now_counters.segments_delivered >= before.segments_delivered:
                    delivered = (now_counters.segments_delivered - before.segments_delivered) * \
                        now_counters.segment_bytes
                    path_s = max(0.0, now_counters.path_limited_s - before.path_limited_s)
                    self._delivered[peer] = self._delivered.get(peer, 0) + delivered
                    self._path_s[key] = self._path_s.get(key, 0.0) + path_s
                    moved, bound_s = moved + delivered, max(bound_s, path_s)
                self._last[key] = now_counters
            if pace and dt > 0 and bound_s >= self.path_bound * dt:
                self._bound.setdefault(peer, _PathBound()).add(dt, moved, pace)
        self._window.append((now, dict(self._delivered), dict(self._path_s)))
        while len(self._window) > 2 and now - self._window[1][0] >= self.window_s:
            self._window.popleft()
        start, delivered, path_s = self._window[0]
        seconds = now - start
        if seconds >= self.window_s:
            held = max((s - path_s.get(k, 0.0) for k, s in self._path_s.items()), default=0.0) / seconds
            self._path_limited = max(self._path_limited, min(1.0, held))
            if held >= self.path_bound:
                self._peak = max(self._peak, sum((n - delivered.get(peer, 0)) / seconds
                                                 for peer, n in self._delivered.items()))

    def _at_pace(self, bound: Iterable[_PathBound]) -> bool:
        """Whether these connections together moved at ``reach`` of their paces over the samples they were
        path-bound, one of them for at least ``window_s`` of this stretch."""
        bound = list(bound)
        if max((b.seconds for b in bound), default=0.0) < self.window_s:
            return False
        return sum(b.delivered for b in bound) >= self.reach * sum(b.paced for b in bound)

    def end(self) -> None:
        """The stretch is over: its peak, if it measured one, joins the history."""
        paced_at = self._paced_at
        if self._peak > 0:
            self.peaks.append(self._peak)
            reached = paced_at is not None and self._at_pace(self._bound.values())
            self._climb = self.gain * paced_at if reached else None
            held = paced_at is not None and any(self._at_pace([b]) for b in self._bound.values())
            self._hold = paced_at if held else None
        self.path_limited = self._path_limited
        self.begin()

    def rate(self) -> Optional[float]:
        """The rate to pace the uplink at (bytes/s), or None (see the class docstring)."""
        if not self.peaks:
            return None
        rate = sorted(self.peaks)[(len(self.peaks) - 1) // 2]
        for floor in (self._hold, self._climb):
            if floor is not None:
                rate = max(rate, floor)
        return rate if rate <= self.max_rate else None


class UplinkShares:
    """Paces this peer's connections at their shares of its uplink through ``pace``: an uplink of ``rate`` bytes/s
    where declared, else of the rate ``meter`` measured during earlier runs (nothing paced until it has; it is
    measured while runs hold leases, every ``meter.sample_s``, on the connections to the peers they send to).

    :meth:`share` takes one run's shares (PeerID -> fraction of the uplink, each in [0, 1]) and returns its
    :class:`UplinkLease`. Runs at once to the same peer add up their shares (a connection carries every run's
    streams to that peer), capped at the whole link; a peer no run holds a share of any more is unpaced again.
    Raises ValueError with neither a rate nor a meter, or a rate <= 0.
    """

    def __init__(self, rate: Optional[float], pace: PaceFn, meter: Optional[UplinkMeter] = None):
        if rate is None and meter is None:
            raise ValueError("an uplink needs a declared rate or a meter")
        if rate is not None and not rate > 0:
            raise ValueError(f"the uplink's rate must be > 0 bytes/s, got {rate}")
        self.declared = float(rate) if rate is not None else None
        """The declared rate (bytes/s), or None: measured by ``meter``."""
        self.meter = meter
        self._pace = pace
        self._leases: set[UplinkLease] = set()
        self._rate: Optional[float] = self.declared
        self._sampler: Optional[asyncio.Task] = None
        self._logged_rate: Optional[float] = None

    @property
    def rate(self) -> Optional[float]:
        """The rate (bytes/s) the runs now open are paced at shares of; None: not paced (nothing measured yet)."""
        return self._rate

    def next_rate(self) -> Optional[float]:
        """The rate (bytes/s) the next stretch of runs will be paced at shares of: the declared one, or what
        ``meter`` measured so far (None: nothing yet, or not worth pacing; :meth:`UplinkMeter.rate`)."""
        if self.declared is not None or self.meter is None:
            return self.declared
        return self.meter.rate()

    def share(self, shares: Mapping[str, float]) -> "UplinkLease":
        """Pace each peer of ``shares`` at its share of the uplink (more where other runs hold shares of it too)
        until the lease is closed. Raises ValueError on a share outside [0, 1]; a share of 0 holds nothing. Called
        from the event loop when measuring (the first lease starts the measurement)."""
        bad = {p: s for p, s in shares.items() if not 0 <= s <= 1}
        if bad:
            raise ValueError(f"shares of the uplink must be in [0, 1], got {bad}")
        lease = UplinkLease(self, {p: float(s) for p, s in shares.items() if s > 0})
        if not self._leases and self.meter is not None:  # a stretch of sending starts: the rate measured so far
            self._rate = self.next_rate()
            self._log_measured()
            self.meter.begin(self._rate)
            self._sampler = asyncio.ensure_future(self._sample())
        self._leases.add(lease)
        if self.meter is not None:  # where this run's connections start from
            self._measure()
        self._apply(lease.shares)
        return lease

    def _log_measured(self) -> None:
        """One line when the measured rate is first known, and when it moved by more than 10% since the last."""
        rate, last = self._rate, self._logged_rate
        if rate is None or (last is not None and abs(rate - last) <= 0.1 * last):
            return
        self._logged_rate = rate
        logger.info("uplink measured at %.1f MB/s (%.0f Mbit/s; uplink_mb_s declares it): all-reduces pace their "
                    "connections at shares of it", rate / 1e6, rate * 8 / 1e6)

    def held(self, peer: str) -> float:
        """The share of the uplink ``peer``'s connections are paced at now (0: unpaced)."""
        return min(1.0, sum(lease.shares.get(peer, 0.0) for lease in self._leases))

    def _apply(self, peers: Iterable[str]) -> None:
        for peer in list(peers):
            share = self.held(peer)
            if self._rate is not None:
                self._pace(peer, share * self._rate if share > 0 else None)

    def _closed(self, lease: "UplinkLease") -> None:
        sampler = self._sampler if self._leases == {lease} else None
        if sampler is not None:  # the stretch of sending ends: its last reading, then its peak
            sampler.cancel()
            self._sampler = None
            self._measure()
        self._leases.discard(lease)
        self._apply(lease.shares)
        if sampler is not None:
            assert self.meter is not None  # a sampler runs only with a meter
            self.meter.end()

    def _measure(self) -> None:
        assert self.meter is not None
        rate = self._rate
        self.meter.sample({p: self.held(p) * rate if rate is not None else None
                           for lease in self._leases for p in lease.members})

    async def _sample(self) -> None:
        assert self.meter is not None
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                self._measure()
                await asyncio.sleep(self.meter.sample_s)


class UplinkLease:
    """One run's shares of the uplink (:meth:`UplinkShares.share`)."""

    def __init__(self, owner: UplinkShares, shares: dict[str, float]):
        self._owner = owner
        self.shares = shares
        """PeerID -> share this run holds now."""
        self.members = frozenset(shares)
        """Every peer this run was given a share for (released or not)."""

    def release(self, peer: str) -> None:
        """Everything this run sends to ``peer`` has been handed over: its share goes to the peers this run still
        sends to, in proportion to theirs (so the uplink is not left idle while a slower connection still has
        bytes to move); the last one released leaves ``peer`` unpaced (unless another run holds it)."""
        freed = self.shares.pop(peer, 0.0)
        if self not in self._owner._leases or not freed:
            return
        rest = sum(self.shares.values())
        if rest > 0:
            scale = (rest + freed) / rest
            for other in self.shares:
                self.shares[other] = min(1.0, self.shares[other] * scale)
        self._owner._apply([peer, *self.shares])

    def close(self) -> None:
        """The run is over: every peer it paced is unpaced again (unless another run holds it). Closing twice does
        nothing."""
        if self in self._owner._leases:
            self._owner._closed(self)
