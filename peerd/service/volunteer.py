"""What makes a daemon a volunteer's service, around whatever role it runs.

:class:`VolunteerServices` owns, for one daemon's lifetime: the pause gate (``peerd pause``/``resume``, active
hours), the local control socket, systemd notifications and watchdog, the Prometheus endpoint, bandwidth pacing of
the role's streams, the daemon's event bus (:attr:`VolunteerServices.events`, which logs every event) and the
daemon's view of its own progress (for ``peerd health``): health, metrics and systemd status lines subscribe to the
bus, so a role reports by publishing typed events (:mod:`peerd.events`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from typing import Any, Mapping, Optional

from peerd.config import NodeConfig
from peerd.service.control import ControlServer
from peerd.service.health import DaemonState, assess_health
from peerd.service.pause import USER_REASON, PauseGate
from peerd.service.rules import Probes, RuleEnforcer, VolunteerRules, psutil_probes
from peerd.service.schedule import ActiveHours, enforce_active_hours
from peerd.service.systemd import Notifier, watchdog_interval_s, watchdog_loop
from peerd.events import (
    Bandwidth,
    BandwidthCaps,
    ControlCommand,
    ControlSocketServing,
    Evaluated,
    Event,
    EventBus,
    LogEvents,
    MetricsServing,
    Paused,
    Resumed,
    RoundDone,
    RoundFailed,
    StageRoundDone,
)
from peerd.runtime.processes import reap
from peerd.transport.pacing import PacedStreams, PacedTransport, pace

logger = logging.getLogger(__name__)

#: Shortest interval between two reads of the run's status records for the ``peers_seen`` metric, in seconds.
PEERS_POLL_MIN_S = 5.0


class ServiceError(RuntimeError):
    """A service the volunteer asked for cannot start (e.g. the metrics port is taken)."""


class VolunteerServices:
    """Use as ``async with VolunteerServices(node, "worker", stop, run_id) as services:`` around a role; ``role``
    is ``bootstrap`` for a DHT-only node, else a placeholder until :meth:`set_role` names the run's role."""

    def __init__(self, node: NodeConfig, role: str, stop: asyncio.Event, run_id: Optional[str] = None,
                 environ: Mapping[str, str] = os.environ, probes: Optional[Probes] = None):
        self.node = node
        self.role = role
        self.stop = stop
        self.gate = PauseGate()
        self.state = DaemonState(role=role, run_id=run_id, started_at=time.time())
        self.notifier = Notifier.from_env(environ)
        self.watchdog_s = watchdog_interval_s(environ)
        self.streams: Optional[PacedStreams] = None
        self.metrics = None
        self.metrics_port: Optional[int] = None
        self.peers_seen: Optional[int] = None
        self.peer_id: Optional[str] = None  # this daemon's PeerID, once its transport is up
        self.device_in_use: Optional[str] = None  # where the role trains (node.device may say "auto")
        self.control_path: Optional[str] = None
        self._kind = "bootstrap" if role == "bootstrap" else "worker"  # which default control socket it serves
        self._control = ControlServer(node.control_socket_path_for(self._kind), self._handle)
        self._tasks: list[asyncio.Task] = []
        self._stopping_sent = False
        self.events = EventBus(LogEvents(), self.state.observe, self._systemd_status, self._round_end)
        self.pause_after_round = False
        """Set by the control command ``pause_after_round``: pause once the role's current round ends."""
        self.rules = RuleEnforcer(VolunteerRules.from_node(node), self.gate, probes or psutil_probes())
        if node.metrics_port is not None:
            from peerd.service.metrics import Metrics  # prometheus_client only when asked for

            self.metrics = Metrics(lambda: self.streams.report() if self.streams else None)
            self.events.subscribe(self.metrics.observe)

    # ---------------------------------------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> "VolunteerServices":
        try:
            await self._start()
        except BaseException:
            await self._close()
            raise
        return self

    async def _start(self) -> None:
        path = self.node.control_socket_path_for(self._kind)
        try:
            if await self._control.start():
                self.control_path = str(path)
                self.events.publish(ControlSocketServing(str(path)))
            else:
                logger.warning("another peerd daemon (pid %s) serves the control socket %s: this one runs without "
                               "one (give it its own --checkpoint-dir or control_socket)", self._control.holder, path)
        except OSError as e:
            logger.warning("cannot create the control socket %s: %s; pause/resume/health are unavailable", path, e)
        if self.metrics is not None:
            try:
                self.metrics_port = self.metrics.serve(self.node.metrics_host, self.node.metrics_port)
            except OSError as e:
                raise ServiceError(f"cannot serve metrics on {self.node.metrics_host}:{self.node.metrics_port}: {e}"
                                   ) from None
            self.events.publish(MetricsServing(self.node.metrics_host, self.metrics_port))
        if self.watchdog_s:
            self._spawn(watchdog_loop(self.notifier, self.watchdog_s))
        self._spawn(self._notify_stopping())
        if self.node.active_hours:
            self._spawn(enforce_active_hours(ActiveHours.parse(self.node.active_hours), self.gate))
        if self.role != "bootstrap":
            self._spawn(self.rules.run())
        self.notifier.status("starting")

    async def __aexit__(self, *exc: Any) -> None:
        await self._close()

    async def _close(self) -> None:
        if not self._stopping_sent:
            self._stopping_sent = True
            self.notifier.notify("STOPPING=1")
        if self.streams is not None:
            report = self.streams.report()
            self.events.publish(Bandwidth(report["upload"], report["download"]))
        await reap(*self._tasks)
        await self._control.close()
        if self.metrics is not None:
            self.metrics.close()
        self.notifier.close()

    def _spawn(self, coro: Any) -> None:
        self._tasks.append(asyncio.ensure_future(coro))

    async def _notify_stopping(self) -> None:
        await self.stop.wait()
        self._stopping_sent = True
        self.notifier.notify("STOPPING=1", "STATUS=stopping: leaving rounds, checkpointing")

    # -------------------------------------------------------------------------------------------------- role hooks

    def pace(self, transport: Any) -> PacedTransport:
        """The transport the role gets: same discovery, streams paced at the node's caps and metered."""
        up, down = self.node.upload_limit_mb_s, self.node.download_limit_mb_s
        uplink = self.node.uplink_mb_s
        self.streams = pace(transport.streams, up * 1e6, down * 1e6, uplink * 1e6)
        shares = self.streams.uplink
        paced = shares.declared / 1e6 if shares is not None and shares.declared else 0.0
        measured = shares is not None and shares.declared is None
        if up or down or paced or measured:
            self.events.publish(BandwidthCaps(up, down, paced, measured))
        if uplink and not paced:
            logger.warning("uplink_mb_s = %g: not paced, the streams cannot pace their connections (data_plane = "
                           "\"p2p\", or not Linux)", uplink)
        return PacedTransport(transport.discovery, self.streams)

    def set_role(self, name: str) -> None:
        """The role this daemon runs (its ``Role.name``: ``diloco``, ``swarm``, ``spes``), once the run's config
        chose it; the control socket and ``peerd health`` report it."""
        if self.role == "bootstrap" or name == "bootstrap":
            raise ValueError("a bootstrap node runs no role, and a worker is no bootstrap node")
        self.role = self.state.role = name

    def ready(self, status: str) -> None:
        """The role serves: tell systemd (READY=1) and count a bootstrap node as joined."""
        if self.role == "bootstrap":
            self.state.joined_at = time.time()
        self.notifier.notify("READY=1", "STATUS=" + status)

    def watch_peers(self, discovery: Any, status_key: str) -> None:
        """Keep ``peers_seen`` (live peers of the run, from their status records under ``status_key``) up to
        date."""
        interval = max(PEERS_POLL_MIN_S, 2 * self.node.status_interval_s)

        async def poll() -> None:
            while True:
                with contextlib.suppress(ConnectionError):  # the DHT unreachable now (DiscoveryError): poll again
                    records = await discovery.get(status_key)
                    live = [p for p, r in records.items() if isinstance(r.value, dict) and r.value.get("role") != "left"]
                    self.peers_seen = len(live)
                    if self.metrics is not None:
                        self.metrics.peers_seen.set(len(live))
                await asyncio.sleep(interval)

        self._spawn(poll())

    # ------------------------------------------------------------------------------------------------ control, status

    def snapshot(self) -> dict[str, Any]:
        node = self.node
        return {
            "pid": os.getpid(), "role": self.role, "run_id": self.state.run_id, "paused": self.gate.paused,
            "peer_id": self.peer_id, "device_in_use": self.device_in_use,
            "pause_reasons": self.gate.reasons, "state": self.state.to_dict(), "peers_seen": self.peers_seen,
            "bandwidth": self.streams.report() if self.streams else None, "metrics_port": self.metrics_port,
            "pause_after_round": self.pause_after_round, "snoozed_until": self.rules.snoozed_until,
            "rules": {**dataclasses.asdict(self.rules.rules), "gpu": node.gpu},
            "machine": {"others_cpu_percent": self.rules.others_cpu_percent, "on_battery": self.rules.on_battery},
            "limits": {"device": node.device, "threads": node.threads, "gpu_memory_fraction": node.gpu_memory_fraction,
                       "upload_limit_mb_s": node.upload_limit_mb_s, "download_limit_mb_s": node.download_limit_mb_s,
                       "uplink_mb_s": node.uplink_mb_s,
                       "active_hours": node.active_hours},
        }

    def _round_end(self, event: Event) -> None:
        """"Finish the round, then pause": the first round end after the request pauses the gate."""
        if self.pause_after_round and isinstance(event, (RoundDone, StageRoundDone, RoundFailed)):
            self.pause_after_round = False
            changed = self.gate.pause(USER_REASON, "paused by the volunteer after a round")
            self.events.publish(ControlCommand("pause", changed, self.gate.paused, self.gate.describe()))

    async def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        cmd = request["cmd"]
        if cmd == "status":
            return {"ok": True, **self.snapshot()}
        if cmd == "health":
            max_age = request.get("max_age_s") or self.node.health_max_age_s
            if not isinstance(max_age, (int, float)) or max_age <= 0:
                return {"ok": False, "error": f"max_age_s must be a positive number, got {max_age!r}"}
            healthy, message = assess_health(self.state, self.gate.reasons, time.time(), float(max_age))
            return {"ok": True, "healthy": healthy, "message": message, "pid": os.getpid()}
        if cmd in ("pause", "resume", "pause_after_round", "set_rules", "snooze") and self.role == "bootstrap":
            return {"ok": False, "error": "a bootstrap node does not train: nothing to pause, resume or rule"}
        if cmd == "set_rules":
            changes = request.get("rules")
            if not isinstance(changes, dict):
                return {"ok": False, "error": "set_rules needs 'rules': a table of rule -> value"}
            try:
                self.rules.set_rules(self.rules.rules.updated(changes))
            except ValueError as e:
                return {"ok": False, "error": str(e)}
            logger.info("volunteer rules now %s (until the daemon restarts; the node config keeps them)",
                        self.rules.rules, extra={"event": "rules_set", **dataclasses.asdict(self.rules.rules)})
            return {"ok": True, "rules": dataclasses.asdict(self.rules.rules), "paused": self.gate.paused,
                    "pause_reasons": self.gate.reasons}
        if cmd == "snooze":
            from peerd.service.rules import snooze_deadline

            try:
                until = snooze_deadline(str(request.get("for", "")), time.time())
            except ValueError as e:
                return {"ok": False, "error": str(e)}
            changed = self.rules.snooze(until)
            logger.info("snoozed until %s" % time.strftime("%a %H:%M", time.localtime(until)) if until
                        else "snooze lifted", extra={"event": "control_snooze", "until": until})
            return {"ok": True, "changed": changed, "paused": self.gate.paused, "pause_reasons": self.gate.reasons,
                    "snoozed_until": self.rules.snoozed_until, "pid": os.getpid()}
        if cmd == "pause_after_round":
            if self.gate.paused:
                return {"ok": True, "changed": False, "paused": True, "pause_reasons": self.gate.reasons,
                        "pause_after_round": False, "pid": os.getpid()}
            self.pause_after_round = True
            logger.info("pausing once the current round ends", extra={"event": "control_pause_after_round"})
            return {"ok": True, "changed": True, "paused": False, "pause_reasons": self.gate.reasons,
                    "pause_after_round": True, "pid": os.getpid()}
        if cmd in ("pause", "resume"):
            self.pause_after_round = False  # a pause now or a resume supersedes a pending "after the round"
            if cmd == "pause":
                changed = self.gate.pause(USER_REASON, "paused by the volunteer (peerd pause)")
            else:
                changed = self.gate.resume(USER_REASON)
            self.events.publish(ControlCommand(cmd, changed, self.gate.paused, self.gate.describe()))
            return {"ok": True, "changed": changed, "paused": self.gate.paused, "pause_reasons": self.gate.reasons,
                    "pid": os.getpid()}
        return {"ok": False, "error": f"unknown command {cmd!r} (status, pause, resume, pause_after_round, "
                                      "snooze, set_rules, health)"}

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer one control request as the control socket does (the in-process dashboard calls this)."""
        return await self._handle(request)

    def _systemd_status(self, event: Event) -> None:
        if not self.notifier.enabled:
            return
        if isinstance(event, RoundDone):
            self.notifier.status(f"outer round {event.outer_round} done, group of {event.group_size}")
        elif isinstance(event, RoundFailed):
            self.notifier.status(f"round {event.outer_round} failed: {event.reason}")
        elif isinstance(event, Paused):
            self.notifier.status(f"paused: {self.gate.describe()}")
        elif isinstance(event, (Resumed, Evaluated)) and self.state.worker_state == "training":
            self.notifier.status(f"training run {self.state.run_id}, {self.state.outer_round} rounds done")
