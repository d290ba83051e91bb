"""What matchmaking is configured with and what it gives: :class:`MatchmakingConfig`, the sealed :class:`Group`, the
failures, and the admission callback's type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


#: ``admit(own_info, peer_id, peer_info) -> None`` to accept the peer, or a reason string to refuse it.
AdmitFn = Callable[[dict, str, dict], Optional[str]]


@dataclass(frozen=True)
class MatchmakingConfig:
    """Timeouts of group formation (seconds)."""

    matchmaking_timeout_s: float = 30.0
    """Longest a group waits with nobody new joining: counted from when the peer starts matchmaking, restarted
    whenever a new member joins the group it leads."""
    request_timeout_s: float = 5.0
    """Longest a single exchange with the leader (connect, send the join request) may take."""
    poll_interval_s: float = 0.5
    """How often discovery records are re-read while waiting."""
    min_group_size: int = 1
    """A sealed group smaller than this fails the round for all its members."""
    max_wait_s: Optional[float] = None
    """Longest a peer matchmakes in all, however the group keeps growing; None = 3 x ``matchmaking_timeout_s``."""

    def __post_init__(self) -> None:
        if self.matchmaking_timeout_s <= 0 or self.request_timeout_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("matchmaking timeouts and poll interval must be positive")
        if self.request_timeout_s >= self.matchmaking_timeout_s:
            raise ValueError(
                f"request_timeout_s ({self.request_timeout_s}) must be smaller than matchmaking_timeout_s "
                f"({self.matchmaking_timeout_s}): a join request must fit inside the matchmaking window"
            )
        if self.poll_interval_s >= self.matchmaking_timeout_s:
            raise ValueError("poll_interval_s must be smaller than matchmaking_timeout_s")
        if self.min_group_size < 1:
            raise ValueError(f"min_group_size must be >= 1, got {self.min_group_size}")
        if self.max_wait_s is not None and self.max_wait_s < self.matchmaking_timeout_s:
            raise ValueError(f"max_wait_s ({self.max_wait_s}) must be >= matchmaking_timeout_s "
                             f"({self.matchmaking_timeout_s})")

    @property
    def max_wait(self) -> float:
        """``max_wait_s`` with its default filled in (seconds)."""
        return self.max_wait_s if self.max_wait_s is not None else 3.0 * self.matchmaking_timeout_s


@dataclass(frozen=True)
class Group:
    """A sealed averaging group. ``members`` are sorted PeerIDs (this peer included); ``infos`` maps each member to
    the info it gave when joining."""

    group_id: str
    key: str
    leader: str
    members: tuple[str, ...]
    infos: dict[str, dict]


class MatchmakingFailed(Exception):
    """No usable group formed for this key (timeout, too few peers, the group was already sealed)."""


class SealedWithout(MatchmakingFailed):
    """The group for the key was sealed (by ``leader``) before this peer joined it (``on_late="fail"``)."""

    def __init__(self, key: str, leader: str):
        super().__init__(f"the group for {key!r} was already sealed by {leader}")
        self.key = key
        self.leader = leader


class AdmissionRefused(MatchmakingFailed):
    """The leader refused this peer (``reason`` says why, e.g. an outer state that differs from the leader's)."""

    def __init__(self, leader: str, reason: str):
        super().__init__(f"leader {leader} refused us: {reason}")
        self.leader = leader
        self.reason = reason
