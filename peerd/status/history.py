"""A peer's compact recent history (training loss, held-out loss, tokens/s), carried in its status record.

A dashboard opened late still draws curves: every status record carries the optional field ``history`` (see
:mod:`peerd.status.records`), at most :data:`MAX_POINTS` points per series, thinned evenly over the daemon's lifetime.

Wire form (JSON/msgpack friendly, numbers only)::

    {"loss": [[time_s, tokens, loss, tokens_per_s], ...],   # training loss, nats/byte; tokens/s of the window
     "eval": [[time_s, tokens, eval_nats_per_byte], ...]}   # held-out loss after an outer round or a join

``time_s`` is Unix seconds, ``tokens`` the peer's cumulative training tokens (an estimate between outer rounds:
tokens/s integrated over time), every value a finite number or None. :class:`RecentHistory` subscribes to the
daemon's event bus (:mod:`peerd.events`), so no role needs a hook of its own.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping, Optional

from peerd.events import Event, event_fields

#: Most points per series in a status record (a record stays a few kB).
MAX_POINTS = 48
#: Points per series a reader accepts (a later writer may keep a few more).
MAX_POINTS_READ = 128
#: Series -> number of values per point.
SERIES = {"loss": 4, "eval": 3}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def history_problem(value: Any) -> Optional[str]:
    """None if ``value`` is a readable ``history`` field, else what is wrong. Unknown series are no problem (a later
    version may add some); a known series must be a list of at most MAX_POINTS_READ points of the right length,
    each value a finite number or None, the time of each point a finite number."""
    if not isinstance(value, dict):
        return f"not a table but {type(value).__name__}"
    for name, width in SERIES.items():
        points = value.get(name, [])
        if not isinstance(points, list) or len(points) > MAX_POINTS_READ:
            return f"{name} is not a list of at most {MAX_POINTS_READ} points"
        for point in points:
            if not isinstance(point, (list, tuple)) or len(point) != width:
                return f"{name} has a point that is not a list of {width} numbers"
            if not _finite(point[0]) or not all(v is None or _finite(v) for v in point[1:]):
                return f"{name} has a point with a value that is not a finite number or null"
    return None


def known_series(value: Mapping[str, Any]) -> dict[str, list[list]]:
    """The series of a readable ``history`` this version knows (absent ones empty)."""
    return {name: [list(p) for p in value.get(name, [])] for name in SERIES}


def thin(points: list, limit: int) -> list:
    """At most ``limit`` points of ``points`` (ordered by time, first value): drops the point whose neighbours are
    closest in time, again and again, so the kept points spread over the whole span. First and last stay."""
    points = list(points)
    while len(points) > max(limit, 2):
        gaps = [points[i + 1][0] - points[i - 1][0] for i in range(1, len(points) - 1)]
        del points[1 + gaps.index(min(gaps))]
    return points


def _r(value: Optional[float], digits: int = 4) -> Optional[float]:
    return None if value is None or not _finite(value) else round(float(value), digits)


class RecentHistory:
    """Collects the history of this daemon's role from its events; :meth:`compact` gives the ``history`` field.

    Subscribe it to the event bus (``bus.subscribe(history)``). It reads ``inner`` (loss, tokens/s),
    ``swarm_progress`` (loss), ``eval`` and ``outer_round`` (held-out loss, cumulative tokens).
    """

    def __init__(self, max_points: int = MAX_POINTS, clock: Callable[[], float] = time.time):
        self.max_points = max_points
        self._clock = clock
        self.loss: list[list] = []
        self.eval: list[list] = []
        self._tokens: Optional[float] = None  # cumulative tokens, last known or estimated
        self._tokens_at: Optional[float] = None
        self._rate: Optional[float] = None

    def _tokens_now(self, now: float) -> Optional[float]:
        if self._tokens is None:
            return None
        if self._rate and self._tokens_at is not None:
            self._tokens += self._rate * max(0.0, now - self._tokens_at)
        self._tokens_at = now
        return self._tokens

    def _anchor(self, tokens: Any, now: float) -> None:
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
            self._tokens, self._tokens_at = float(tokens), now

    def __call__(self, event: "Event | Mapping[str, Any]") -> None:
        fields = event_fields(event)
        kind = fields.get("event")
        now = self._clock()
        if kind in ("inner", "swarm_progress") and _finite(fields.get("loss")):
            rate = fields.get("tokens_per_s")
            tokens = self._tokens_now(now)
            if _finite(rate):
                self._rate = float(rate)
                if self._tokens is None:
                    self._tokens, self._tokens_at = 0.0, now
            self._add(self.loss, [round(now, 1), None if tokens is None else int(tokens), _r(fields["loss"]),
                                  _r(rate, 1)])
        elif kind == "paused":  # no tokens while paused: stop the estimate
            self._tokens_now(now)
            self._rate = None
        elif kind in ("eval", "outer_round"):
            self._anchor(fields.get("tokens"), now)
            if _finite(fields.get("eval_nats_per_byte")):
                tokens = self._tokens
                self._add(self.eval, [round(now, 1), None if tokens is None else int(tokens),
                                      _r(fields["eval_nats_per_byte"])])

    def _add(self, series: list, point: list) -> None:
        series.append(point)
        if len(series) > self.max_points:
            series[:] = thin(series, self.max_points)

    def compact(self) -> dict[str, list[list]]:
        """The ``history`` field: copies of both series (at most ``max_points`` points each)."""
        return {"loss": [list(p) for p in self.loss], "eval": [list(p) for p in self.eval]}
