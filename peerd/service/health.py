"""What the local daemon knows about itself, and whether it is healthy.

:class:`DaemonState` subscribes to the daemon's event bus (:mod:`peerd.events`: round done, eval, state
download, round failed, paused, resumed, leave), so roles need no extra hooks to report. :func:`assess_health` is pure: the control socket answers ``peerd health`` with it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from peerd.events import Event, event_fields


@dataclass
class DaemonState:
    """Progress of this daemon's role, in wall-clock seconds (``time.time()``)."""

    role: str
    """The role's name (``diloco``, ``swarm``, ``spes``), ``bootstrap``, or ``worker`` until the run's role is known."""
    run_id: Optional[str] = None
    started_at: float = 0.0
    joined_at: Optional[float] = None
    """When the role last joined the run: ready to train (after any catch-up), a state download, or a resume."""
    last_round_at: Optional[float] = None
    """When the last outer round completed."""
    outer_round: Optional[int] = None
    rounds_completed: int = 0
    rounds_failed: int = 0
    worker_state: str = "starting"
    """starting | training | paused | left (as the role reported it)."""
    last_loss: Optional[float] = None
    last_eval_nats_per_byte: Optional[float] = None

    def observe(self, event: "Event | Mapping[str, Any]", now: Optional[float] = None) -> None:
        """Update from one event (an :class:`peerd.events.Event`, or its fields: a dict with at least ``event``)."""
        event = event_fields(event)
        now = time.time() if now is None else now
        kind = event.get("event")
        if isinstance(event.get("outer_round"), int):
            self.outer_round = event["outer_round"]
        if kind == "eval" and self.joined_at is None:  # the role's first evaluation: it has joined and trains now
            self.joined_at, self.worker_state = now, "training"
        elif kind == "state_download":
            self.joined_at = now
        elif kind == "outer_round":
            self.last_round_at = now
            self.rounds_completed += 1
        elif kind == "round_failed":
            self.rounds_failed += 1
        elif kind == "paused":
            self.worker_state = "paused"
        elif kind == "resumed":
            self.worker_state, self.joined_at = "training", now  # rejoining counts as joining
        elif kind == "leave":
            self.worker_state = "left"
        elif kind == "inner" and isinstance(event.get("loss"), (int, float)):
            self.last_loss = float(event["loss"])
        if kind in ("eval", "outer_round") and isinstance(event.get("eval_nats_per_byte"), (int, float)):
            self.last_eval_nats_per_byte = float(event["eval_nats_per_byte"])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def assess_health(
    state: DaemonState, pause_reasons: Mapping[str, str], now: float, max_age_s: float
) -> tuple[bool, str]:
    """``(healthy, one line)``. Healthy: a bootstrap node that is up; a paused worker (it rests on purpose); a worker
    that completed or joined a round in the last ``max_age_s`` seconds."""
    if state.role == "bootstrap":
        if state.joined_at is None:
            return False, f"bootstrap node starting ({now - state.started_at:.0f} s)"
        return True, f"bootstrap node up for {now - state.joined_at:.0f} s"
    run = f"run {state.run_id}"
    if pause_reasons:
        return True, f"{run}: paused ({'; '.join(pause_reasons.values())})"
    if state.worker_state == "left":
        return False, f"{run}: the worker has left the run"
    if state.joined_at is None:
        return False, f"{run}: not joined yet (daemon up for {now - state.started_at:.0f} s)"
    if state.last_round_at is not None and state.last_round_at >= state.joined_at:
        what, at = f"outer round {state.outer_round} completed", state.last_round_at
    else:
        what, at = "joined", state.joined_at
    age = now - at
    if age > max_age_s:
        return False, (f"{run}: no round completed or joined for {age:.0f} s (limit {max_age_s:.0f} s; "
                       f"{state.rounds_failed} failed rounds)")
    return True, f"{run}: {what} {age:.0f} s ago"
