"""One key's matchmaking as this peer sees it (:class:`_Session`, its followers when it leads) and the leader's pure
decisions on it: who leads, who is still awaited, when the group seals."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from protocols.matchmaking.config import Group


@dataclass
class _Follower:
    info: dict
    deadline: float  # loop time by which the follower wants an answer (its whole wait, max_wait_s)
    answer: asyncio.Future
    closed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Session:
    key: str
    info: dict
    deadline: float  # loop time at which this peer gives up (max_wait_s after it started)
    idle_until: float  # loop time at which a group this peer leads seals for lack of new members
    expected_size: Optional[int]
    expected_members: Optional[frozenset] = None  # when known: seal once all joined, else at max_wait (no idle seal)
    expects: Optional[tuple[str, ...]] = None  # the peers we believe are coming (our view), sent when joining
    pooled: Optional[set[str]] = None  # as leader: the peers any member expects (our view and the followers' joined)
    round_prefix: Optional[str] = None  # keys of the same round's other groups start with it
    probe_failures: dict[str, int] = field(default_factory=dict)  # missing expected member -> failed probes in a row
    following: Optional[str] = None  # the leader we defer to, when not leading
    expiration: float = 0.0  # discovery time at which our discovery record for the key expires
    sealed: bool = False
    followers: dict[str, _Follower] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


def _rank(peer: str, record: Any) -> tuple[bool, str]:
    """Who leads a key: the smallest (dial-only, PeerID), so peers that can be dialed lead before those that cannot."""
    value = getattr(record, "value", None)
    return isinstance(value, dict) and value.get("dial_only") is True, peer


def _rival_key(session: _Session, keys: Sequence[str]) -> Optional[str]:
    """The first of a probed member's ``keys`` that is another group of ``session``'s round (not ours, nor our
    groups of late peers), or None."""
    if session.round_prefix is None:
        return None
    for key in keys:
        if key.startswith(session.round_prefix) and key != session.key and not key.startswith(session.key + "."):
            return key
    return None


def _awaited(session: _Session, me: str) -> set[str]:
    """The peers that some member of the group ``session`` leads expects (pooled views) and that have not joined."""
    if session.pooled is None:
        return set()
    return session.pooled - session.followers.keys() - {me}


def _deadline(session: _Session) -> float:
    """Loop time at which some member of the group ``session`` leads (or the leader) cannot wait any longer."""
    return min([session.deadline] + [f.deadline for f in session.followers.values()])


def _seal_at(session: _Session) -> float:
    """Loop time at which the group ``session`` leads seals: at :func:`_deadline`, or, members unknown, when nobody
    new has joined for ``matchmaking_timeout_s``."""
    deadline = _deadline(session)
    if session.expected_members is None:
        deadline = min(deadline, session.idle_until)
    return deadline


class _Late(Exception):
    """The group for the key was sealed (by ``leader``) before we joined it."""

    def __init__(self, message: str, leader: str):
        super().__init__(message)
        self.leader = leader


def _group_answer(group: Group) -> dict[str, Any]:
    return {"type": "group", "group_id": group.group_id, "members": list(group.members), "infos": group.infos}
