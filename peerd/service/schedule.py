"""Active hours: the local-time windows in which a volunteer's peer trains.

A pure core (:class:`ActiveHours`: parse, ``is_active``, ``seconds_until_change``; no clock of its own) and a small
async enforcer that pauses and resumes a :class:`peerd.service.pause.PauseGate` on a clock it is handed, so tests drive it
with a fake clock.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Awaitable, Callable

logger = logging.getLogger(__name__)

_WINDOW = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")
_DAY = 24 * 60


@dataclass(frozen=True)
class ActiveHours:
    """Windows ``[start, end)`` in minutes since local midnight; a window whose end is before its start wraps
    midnight (``22:00-07:00``). ``00:00-24:00`` is the whole day."""

    spec: str
    windows: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, spec: str) -> "ActiveHours":
        """Parse ``"HH:MM-HH:MM[,HH:MM-HH:MM...]"``. Raises ValueError with the offending part."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"expected windows like '22:00-07:00' or '09:00-12:00,18:00-23:30', got {spec!r}")
        windows = []
        for part in spec.split(","):
            m = _WINDOW.match(part)
            if not m:
                raise ValueError(f"{part.strip()!r} is not a window like '22:00-07:00'")
            h1, m1, h2, m2 = (int(g) for g in m.groups())
            for h, mi in ((h1, m1), (h2, m2)):
                if not (0 <= h <= 24 and 0 <= mi <= 59) or (h == 24 and mi != 0):
                    raise ValueError(f"{part.strip()!r}: {h:02d}:{mi:02d} is not a time of day")
            start, end = h1 * 60 + m1, h2 * 60 + m2
            if start == end % _DAY and not (start == 0 and end == _DAY):
                raise ValueError(f"{part.strip()!r} is empty (start equals end); leave active_hours unset for always")
            if start == _DAY:
                raise ValueError(f"{part.strip()!r} starts at 24:00; use 00:00")
            windows.append((start, end))
        return cls(spec, tuple(windows))

    def is_active(self, when: datetime) -> bool:
        """True if local time ``when`` lies in a window."""
        minute = when.hour * 60 + when.minute + (when.second + when.microsecond / 1e6) / 60
        for start, end in self.windows:
            if start < end:
                if start <= minute < end:
                    return True
            elif minute >= start or minute < end:  # wraps midnight
                return True
        return False

    def seconds_until_change(self, when: datetime) -> float:
        """Seconds from ``when`` until ``is_active`` flips; ``inf`` if it never does (windows cover the day)."""
        now_active = self.is_active(when)
        midnight = when.replace(hour=0, minute=0, second=0, microsecond=0)
        boundaries = sorted({minute % _DAY for window in self.windows for minute in window})
        for day in (0, 1):
            for minute in boundaries:
                candidate = midnight + timedelta(days=day, minutes=minute)
                if candidate > when and self.is_active(candidate) != now_active:
                    return (candidate - when).total_seconds()
        return float("inf")


SCHEDULE_REASON = "schedule"


async def enforce_active_hours(
    hours: ActiveHours,
    gate: Any,
    now: Callable[[], datetime] = datetime.now,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    max_sleep_s: float = 60.0,
) -> None:
    """Forever: pause ``gate`` (reason ``"schedule"``) outside ``hours`` and lift that pause inside them.

    Re-checks at each window boundary and at least every ``max_sleep_s`` (a suspended laptop or a clock change).
    """
    while True:
        when = now()
        if hours.is_active(when):
            if gate.resume(SCHEDULE_REASON):
                logger.info("inside active hours %s: training again", hours.spec)
        elif gate.pause(SCHEDULE_REASON, f"outside active hours {hours.spec}"):
            logger.info("outside active hours %s: leaving rounds and pausing", hours.spec)
        await sleep(min(max_sleep_s, max(1.0, hours.seconds_until_change(when))))
