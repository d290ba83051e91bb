"""The pause gate: why this peer is paused (the volunteer asked, or it is outside its active hours).

A role checks the gate at safe points: it does not start inner steps or matchmaking while paused, abandons
matchmaking when a pause arrives (like a stop), and lets a running all-reduce finish, so the others' round is not
broken. The gate itself only records reasons and wakes waiters; it never touches the network.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

#: Reason set by ``peerd pause`` / cleared by ``peerd resume``.
USER_REASON = "user"


class PauseGate:
    """Paused while any reason is set. Reasons are keyed (``"user"``, ``"schedule"``) with a human description."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._reasons: dict[str, str] = {}
        self._clock = clock
        self._running = asyncio.Event()
        self._running.set()
        self._paused = asyncio.Event()
        self.paused_since: float | None = None

    @property
    def paused(self) -> bool:
        return bool(self._reasons)

    @property
    def reasons(self) -> dict[str, str]:
        return dict(self._reasons)

    def describe(self) -> str:
        return "; ".join(self._reasons.values()) or "running"

    def pause(self, key: str, description: str) -> bool:
        """Add a reason; True if the gate was running before."""
        was_paused = self.paused
        self._reasons[key] = description
        if not was_paused:
            self.paused_since = self._clock()
            self._running.clear()
            self._paused.set()
        return not was_paused

    def resume(self, key: str) -> bool:
        """Remove a reason (no-op if absent); True if the gate runs again because of it."""
        if self._reasons.pop(key, None) is None or self._reasons:
            return False
        self.paused_since = None
        self._paused.clear()
        self._running.set()
        return True

    async def wait_running(self) -> None:
        """Return once no reason is set."""
        while self._reasons:
            await self._running.wait()

    async def wait_paused(self) -> None:
        """Return once some reason is set (a role races this against matchmaking)."""
        while not self._reasons:
            await self._paused.wait()
