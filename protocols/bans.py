"""Temporary bans of peers that sent invalid data or stalled a round.

A ban is local (each peer keeps its own list) and expires after ``ban_s`` seconds, so an honest peer that was merely
slow once comes back. Runners consult :meth:`BanList.is_banned` before accepting anything from a peer and call
:meth:`BanList.ban` when a peer misbehaves; ``on_ban`` lets the daemon log and count each ban.
"""

from __future__ import annotations

import time
from typing import Callable, Optional


class BanList:
    """PeerID -> (expiry, reason). ``clock`` is injectable for tests (seconds, monotonic)."""

    def __init__(
        self,
        ban_s: float = 120.0,
        on_ban: Optional[Callable[[str, str], None]] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if ban_s <= 0:
            raise ValueError(f"ban_s must be positive, got {ban_s}")
        self.ban_s = ban_s
        self.on_ban = on_ban
        self.clock = clock
        self._until: dict[str, tuple[float, str]] = {}
        self.total = 0

    def ban(self, peer: str, reason: str) -> None:
        """Ban ``peer`` for ``ban_s`` seconds from now (extends a running ban)."""
        self._until[peer] = (self.clock() + self.ban_s, reason)
        self.total += 1
        if self.on_ban is not None:
            self.on_ban(peer, reason)

    def is_banned(self, peer: str) -> bool:
        entry = self._until.get(peer)
        if entry is None:
            return False
        if entry[0] <= self.clock():
            del self._until[peer]
            return False
        return True

    def reason(self, peer: str) -> Optional[str]:
        return self._until[peer][1] if self.is_banned(peer) else None

    def active(self) -> dict[str, str]:
        """Currently banned peers and why."""
        return {p: r for p, (_, r) in list(self._until.items()) if self.is_banned(p)}
