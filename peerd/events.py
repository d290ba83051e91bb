"""Typed events of a daemon and the bus that carries them to logs, metrics, health and systemd.

A role (or the daemon's services) *publishes* an event; subscribers receive the event object. The log subscriber
(:class:`LogEvents`) writes each as the log line it always was, with the event's fields as ``extra`` (so JSON log
lines carry ``event``, ``outer_round``, ``group_size``... as keys, which tests and log shippers read). Nothing learns
state by reading log records: metrics, health and systemd status lines subscribe to the bus.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    """Base of every event. ``name`` is the ``event`` field of its log line; ``fields()`` are that line's extras."""

    name: ClassVar[str] = "event"
    level: ClassVar[int] = logging.INFO
    message_only: ClassVar[tuple[str, ...]] = ()
    """Fields that only the human-readable message uses (not part of the log line's extras)."""

    def fields(self) -> dict[str, Any]:
        """``{"event": name, **every field but message_only}``: exactly the ``extra`` of the event's log line."""
        return {"event": self.name, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                       if f.name not in self.message_only}}

    def message(self) -> str:
        return self.name


def _fmt_eval(nats: Optional[float], unit: str = "byte", bytes_per_token: Optional[float] = None) -> str:
    """``nats`` per ``unit`` (a byte, or a token of the run's BPE) and bits per byte where they compare across
    tokenizers (a BPE run's eval knows the bytes its tokens stand for)."""
    if nats is None:
        return "off"
    if unit == "byte":
        return f"{nats:.4f} nats/byte ({nats / _LN2:.4f} bits/byte)"
    if bytes_per_token:
        return f"{nats:.4f} nats/{unit} ({nats / bytes_per_token / _LN2:.4f} bits/byte)"
    return f"{nats:.4f} nats/{unit}"


_LN2 = 0.6931471805599453


def _when(outer_round: int) -> str:
    """Where a peer stands, in the one numbering of rounds every message uses: round N (from 1) is the outer round
    that makes theta_outer version N, so a peer at version r has r rounds done and trains round r + 1."""
    return f"after round {outer_round}" if outer_round else "before round 1"


@dataclass(frozen=True)
class InnerProgress(Event):
    """A window of inner steps (every ``log_every_steps`` and at the end of a round's quota)."""

    name: ClassVar[str] = "inner"
    message_only: ClassVar[tuple[str, ...]] = ("round_quota",)
    outer_round: int
    inner_step: int
    loss: float
    tokens_per_s: float
    round_quota: int = field(default=0, compare=False)

    def message(self) -> str:
        return (f"round {self.outer_round + 1} step {self.inner_step}/{self.round_quota} loss {self.loss:.4f} "
                f"tokens/s {self.tokens_per_s:.0f}")


@dataclass(frozen=True)
class Evaluated(Event):
    """Held-out evaluation outside a round (at start, after joining). ``eval_nats_per_byte`` None: eval is off."""

    name: ClassVar[str] = "eval"
    outer_round: int
    eval_nats_per_byte: Optional[float]
    """Held-out loss in nats per ``eval_unit`` (the field keeps its name across tokenizers)."""
    tokens: int
    eval_unit: str = "byte"
    """What ``eval_nats_per_byte`` is per: ``byte`` (byte-level runs) or ``token`` (a BPE run's tokens)."""
    eval_bytes_per_token: Optional[float] = None
    """BPE runs: bytes of text per token over the evaluated targets, so bits/byte = nats / this / ln 2."""

    def message(self) -> str:
        return (f"eval {_when(self.outer_round)}: "
                f"{_fmt_eval(self.eval_nats_per_byte, self.eval_unit, self.eval_bytes_per_token)}")


@dataclass(frozen=True)
class RoundDone(Event):
    """An outer round completed: theta_outer is now version ``outer_round``. Bytes in bytes, times in seconds."""

    name: ClassVar[str] = "outer_round"
    outer_round: int
    group_size: int
    bytes_sent: int
    bytes_received: int
    allreduce_s: float
    excluded: Mapping[str, str]
    attempts: int
    round_s: float
    weight: float
    inner_steps: int
    dp_equivalent_bytes: int
    digest: str
    method: str
    eval_nats_per_byte: Optional[float]
    tokens: int
    eval_unit: str = "byte"
    """As :attr:`Evaluated.eval_unit`."""
    eval_bytes_per_token: Optional[float] = None
    """As :attr:`Evaluated.eval_bytes_per_token`."""

    def message(self) -> str:
        return (f"outer round {self.outer_round} done: group {self.group_size}, sent {self.bytes_sent / 1e6:.2f} MB, "
                f"received {self.bytes_received / 1e6:.2f} MB, all-reduce {self.allreduce_s:.2f} s, "
                f"eval {_fmt_eval(self.eval_nats_per_byte, self.eval_unit, self.eval_bytes_per_token)}")


@dataclass(frozen=True)
class StageRoundDone(Event):
    """An outer round of a SWARM stage's replicas completed: the stage's theta_outer is now version
    ``outer_round`` (``digest``: its first 16 hex digits, equal on every replica of the round). Bytes in bytes."""

    name: ClassVar[str] = "stage_round"
    stage: int
    outer_round: int
    group_size: int
    bytes_sent: int
    bytes_received: int
    weight: float
    digest: str

    def message(self) -> str:
        return (f"stage {self.stage} outer round {self.outer_round} done: group {self.group_size}, "
                f"sent {self.bytes_sent / 1e6:.2f} MB")


@dataclass(frozen=True)
class SwarmProgress(Event):
    """A SWARM trainer's micro-batch counts so far: every one ``sent`` ends ``completed`` or ``dropped``;
    ``retried`` counts calls re-sent to a replica after a failure. ``loss``: the last micro-batch's (nats/token)."""

    name: ClassVar[str] = "swarm_progress"
    message_only: ClassVar[tuple[str, ...]] = ("quiet",)
    micro_batches: int
    loss: Optional[float]
    sent: int
    completed: int
    retried: int
    dropped: int
    quiet: bool = field(default=False, compare=False)
    """Logged at debug level (the node's ``swarm_progress_interval_s`` has not passed since the last info line)."""

    @property
    def level(self) -> int:  # type: ignore[override]
        return logging.DEBUG if self.quiet else logging.INFO

    def message(self) -> str:
        loss = "-" if self.loss is None else f"{self.loss:.4f}"
        return (f"swarm trainer: {self.micro_batches} micro-batches, loss {loss}, completed {self.completed}/"
                f"{self.sent}, retried {self.retried}, dropped {self.dropped}")


@dataclass(frozen=True)
class StageMoved(Event):
    """A SWARM server moved from stage ``old_stage`` to the bottleneck stage ``new_stage`` (rebalancing), starting
    from the parameters (and outer state at ``outer_round``) of ``source``, a live server there (empty: the run's
    initial weights). Throughputs in samples per second, None where unmeasured."""

    name: ClassVar[str] = "stage_moved"
    old_stage: int
    new_stage: int
    source: str
    outer_round: int
    old_stage_throughput: Optional[float]
    new_stage_throughput: Optional[float]

    def message(self) -> str:
        return (f"moved from stage {self.old_stage} to stage {self.new_stage} (the bottleneck), parameters from "
                f"{self.source or 'the initial weights'}")


@dataclass(frozen=True)
class RoundFailed(Event):
    """Outer round ``outer_round + 1`` failed; ``consequence`` says what the peer keeps."""

    name: ClassVar[str] = "round_failed"
    level: ClassVar[int] = logging.WARNING
    message_only: ClassVar[tuple[str, ...]] = ("consequence",)
    outer_round: int
    reason: str
    method: str
    consequence: str = field(default="", compare=False)

    def message(self) -> str:
        return f"round {self.outer_round + 1} failed: {self.reason}; {self.consequence}"


@dataclass(frozen=True)
class Paused(Event):
    name: ClassVar[str] = "paused"
    message_only: ClassVar[tuple[str, ...]] = ("local_steps",)
    outer_round: int
    reasons: Mapping[str, str]
    local_steps: int = field(default=0, compare=False)

    def message(self) -> str:
        return (f"paused ({'; '.join(self.reasons.values()) or 'running'}) {_when(self.outer_round)}, "
                f"{self.local_steps} local steps")


@dataclass(frozen=True)
class Resumed(Event):
    name: ClassVar[str] = "resumed"
    outer_round: int

    def message(self) -> str:
        return f"resumed {_when(self.outer_round)}"


@dataclass(frozen=True)
class StateDownloaded(Event):
    """This peer adopted the state of ``peer`` (``megabytes`` of payload; ``dropped_steps`` local steps lost)."""

    name: ClassVar[str] = "state_download"
    message_only: ClassVar[tuple[str, ...]] = ("megabytes", "dropped_steps")
    outer_round: int
    peer: str
    digest: str
    seconds: float
    megabytes: float = field(default=0.0, compare=False)
    dropped_steps: int = field(default=0, compare=False)

    def message(self) -> str:
        dropped = f"; dropped {self.dropped_steps} unsynchronized local steps" if self.dropped_steps else ""
        return (f"downloaded the run's state {_when(self.outer_round)} ({self.megabytes:.1f} MB) from {self.peer} in "
                f"{self.seconds:.2f} s{dropped}")


@dataclass(frozen=True)
class CheckpointResumed(Event):
    """The role resumed from its local checkpoint ``path``."""

    name: ClassVar[str] = "resume"
    message_only: ClassVar[tuple[str, ...]] = ("path", "local_steps")
    outer_round: int
    digest: str
    path: str = field(default="", compare=False)
    local_steps: int = field(default=0, compare=False)

    def message(self) -> str:
        return (f"resumed from {self.path}: {_when(self.outer_round)}, {self.local_steps} local steps since "
                "the last sync")


@dataclass(frozen=True)
class ExpertsClaimed(Event):
    """The SPES role trains ``experts`` (expert indices) from outer round ``outer_round`` on; ``previous``: the
    experts it trained before (empty at the first claim)."""

    name: ClassVar[str] = "experts_claimed"
    outer_round: int
    experts: tuple[int, ...]
    previous: tuple[int, ...] = ()

    def message(self) -> str:
        return f"training experts {list(self.experts)} (was {list(self.previous)}) from round {self.outer_round + 1}"


@dataclass(frozen=True)
class Banned(Event):
    name: ClassVar[str] = "ban"
    level: ClassVar[int] = logging.WARNING
    peer: str
    reason: str
    ban_s: float

    def message(self) -> str:
        return f"banned {self.peer} for {self.ban_s:.0f} s: {self.reason}"


@dataclass(frozen=True)
class Left(Event):
    """The role left run ``run_id`` (bytes in bytes)."""

    name: ClassVar[str] = "leave"
    message_only: ClassVar[tuple[str, ...]] = ("run_id",)
    outer_round: int
    bytes_sent: int
    bytes_received: int
    rounds_failed: int
    run_id: str = field(default="", compare=False)

    def message(self) -> str:
        return (f"leaving run {self.run_id} after {self.outer_round} outer rounds ({self.rounds_failed} failed); "
                f"averaging sent {self.bytes_sent / 1e6:.1f} MB, received {self.bytes_received / 1e6:.1f} MB")


@dataclass(frozen=True)
class Bandwidth(Event):
    """Bytes and achieved rates of the role's streams (``upload``/``download``: the pacer's report)."""

    name: ClassVar[str] = "bandwidth"
    upload: Mapping[str, Any]
    download: Mapping[str, Any]

    def message(self) -> str:
        parts = []
        for direction, side in (("upload", self.upload), ("download", self.download)):
            rate, limit = side.get("achieved_bytes_per_s"), side.get("limit_bytes_per_s")
            parts.append(f"{direction} {side['bytes'] / 1e6:.1f} MB"
                         + (f" at {rate / 1e6:.2f} MB/s" if rate else "")
                         + (f" (cap {limit / 1e6:g} MB/s)" if limit else ""))
        # every byte of the role's streams (frames, matchmaking, state served to joiners): more than the averaged
        # tensors that the leave line counts
        return "bandwidth (all streams): " + ", ".join(parts)


@dataclass(frozen=True)
class BandwidthCaps(Event):
    """The node's bandwidth caps on the role's streams, MB/s (0: unlimited), and the uplink rate its all-reduces
    pace their connections at shares of (``uplink_mb_s``, or the upload cap where lower; 0: none declared), or
    ``measured_uplink``: none declared, the rate measured during earlier all-reduces
    (:class:`peerd.transport.uplink.UplinkMeter`)."""

    name: ClassVar[str] = "bandwidth_caps"
    upload_mb_s: float
    download_mb_s: float
    paced_uplink_mb_s: float = 0.0
    measured_uplink: bool = False

    def message(self) -> str:
        def cap(mb_s: float) -> str:
            return f"{mb_s:g} MB/s" if mb_s else "unlimited"

        caps = (f"bandwidth caps: upload {cap(self.upload_mb_s)}, download {cap(self.download_mb_s)}"
                if self.upload_mb_s or self.download_mb_s else "no bandwidth caps")
        if self.paced_uplink_mb_s:
            return f"{caps}; all-reduce connections paced at their shares of a {self.paced_uplink_mb_s:g} MB/s uplink"
        if self.measured_uplink:
            return (f"{caps}; all-reduce connections paced at their shares of the uplink as measured during earlier "
                    "all-reduces (uplink_mb_s declares it)")
        return caps


@dataclass(frozen=True)
class ControlSocketServing(Event):
    name: ClassVar[str] = "control"
    path: str

    def message(self) -> str:
        return f"control socket {self.path} (peerd pause | resume | health)"


@dataclass(frozen=True)
class MetricsServing(Event):
    name: ClassVar[str] = "metrics"
    host: str
    port: int

    def message(self) -> str:
        return f"Prometheus metrics on http://{self.host}:{self.port}/metrics"


@dataclass(frozen=True)
class ControlCommand(Event):
    """The volunteer ran ``peerd pause`` or ``peerd resume`` (event ``control_pause`` / ``control_resume``)."""

    name: ClassVar[str] = "control_command"
    cmd: str
    changed: bool
    paused: bool
    state: str = field(default="", compare=False)

    def fields(self) -> dict[str, Any]:
        return {"event": f"control_{self.cmd}", "changed": self.changed, "paused": self.paused}

    def message(self) -> str:
        return f"control: {self.cmd}{'' if self.changed else ' (no change)'}; now {self.state}"


@dataclass(frozen=True)
class DuplicateIdentitySeen(Event):
    """Another live daemon publishes status under this peer's PeerID (a copied identity file)."""

    name: ClassVar[str] = "duplicate_identity"
    level: ClassVar[int] = logging.ERROR
    peer: str
    instance: str
    other_instance: str

    def message(self) -> str:
        return (f"another daemon is running with this peer's identity (PeerID {self.peer}; this daemon is instance "
                f"{self.instance}, the other {self.other_instance}): stopping. Give each daemon its own --identity "
                "and --checkpoint-dir")


def event_fields(event: "Event | Mapping[str, Any]") -> Mapping[str, Any]:
    """The fields of an event (as its log line carries them); a mapping is taken as such."""
    return event.fields() if isinstance(event, Event) else event


Subscriber = Callable[[Event], None]


class EventBus:
    """Publish/subscribe of :class:`Event`. A subscriber that raises is reported once (a warning) and keeps
    receiving; it never breaks the publisher or the other subscribers."""

    def __init__(self, *subscribers: Subscriber):
        self._subscribers: list[Subscriber] = list(subscribers)
        self._failed: set[int] = set()

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Add ``subscriber``; returns the function that removes it."""
        self._subscribers.append(subscriber)

        def unsubscribe() -> None:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

        return unsubscribe

    def publish(self, event: Event) -> None:
        for subscriber in list(self._subscribers):
            try:
                subscriber(event)
            except Exception:  # boundary: a subscriber's bug must not stop the publisher; said once, not per event
                if id(subscriber) not in self._failed:
                    self._failed.add(id(subscriber))
                    logger.warning("event subscriber %r failed on %s", subscriber, event.name, exc_info=True)


class LogEvents:
    """The log subscriber: each event becomes the log line it describes, at its level, ``extra`` = its fields."""

    def __init__(self, log: logging.Logger | None = None):
        self.log = log or logging.getLogger("peerd.events")

    def __call__(self, event: Event) -> None:
        self.log.log(event.level, "%s", event.message(), extra=event.fields())
