"""Value types and checks of node-config settings that the layers above the config use too.

:class:`ActiveHours` (the ``active_hours`` windows; :mod:`peerd.service.schedule` enforces them) and the
dashboard's binding rule (:func:`bind_problem`; :mod:`peerd.dashboard.security` guards requests). Pure and
imports nothing of peerd, so :mod:`peerd.config` validates with the same code that later acts on the values.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Optional

# ------------------------------------------------------------------------------------------------------ active hours

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


# -------------------------------------------------------------------------------------------------- dashboard binding

MIN_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_problem(host: str, token: Optional[str]) -> Optional[str]:
    """None if the dashboard may bind ``host`` with ``token``; else the reason it must not start."""
    if not isinstance(host, str) or not host:
        return f"expected an address to bind, got {host!r}"
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        return f"dashboard_token must have at least {MIN_TOKEN_CHARS} characters"
    if not is_loopback(host) and not token:
        return (f"binding the dashboard to {host} exposes it beyond this machine: set dashboard_token (or "
                "PEERD_DASHBOARD_TOKEN, --dashboard-token) to a secret of 16+ characters, or bind 127.0.0.1")
    return None
