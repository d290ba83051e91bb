"""Prometheus metrics of one daemon (``--metrics-port``), fed by the daemon's event bus (:mod:`peerd.events`).

Every metric is named ``peerd_*``; times in seconds, losses in nats per byte, bytes in bytes. The registry is private
to the daemon (no process-wide default registry), so tests can build several.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from peerd.events import Event, event_fields

logger = logging.getLogger(__name__)

ROUND_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
ALLREDUCE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class _StreamCollector:
    """Bytes and achieved rates read from the paced streams' meters at scrape time."""

    def __init__(self, report: Callable[[], Optional[Mapping[str, Mapping[str, Any]]]]):
        self._report = report

    def collect(self):
        report = self._report() or {}
        up, down = report.get("upload", {}), report.get("download", {})
        for name, doc, side in (("peerd_bytes_sent", "Bytes this peer sent on peer streams", up),
                                ("peerd_bytes_received", "Bytes this peer read from peer streams", down)):
            yield CounterMetricFamily(name, doc, value=side.get("bytes", 0))
        rate = GaugeMetricFamily("peerd_achieved_bytes_per_second",
                                 "Rate achieved while transfers were running", labels=["direction"])
        limit = GaugeMetricFamily("peerd_bandwidth_limit_bytes_per_second",
                                  "Configured bandwidth cap (0 = unlimited)", labels=["direction"])
        for direction, side in (("upload", up), ("download", down)):
            rate.add_metric([direction], side.get("achieved_bytes_per_s") or 0.0)
            limit.add_metric([direction], side.get("limit_bytes_per_s") or 0.0)
        yield rate
        yield limit
        uplink = report.get("uplink") or {}
        yield GaugeMetricFamily("peerd_uplink_bytes_per_second", "Uplink rate all-reduces pace their connections at "
                                "shares of, declared or measured (0 = none known: unpaced)",
                                value=uplink.get("bytes_per_s") or 0.0)


class Metrics:
    """The daemon's metrics; :meth:`observe` takes the bus's events, :meth:`serve` exposes them over HTTP."""

    def __init__(self, stream_report: Callable[[], Optional[Mapping[str, Mapping[str, Any]]]] = lambda: None):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.outer_round_seconds = Histogram("peerd_outer_round_seconds", "Matchmaking plus all-reduce of an outer "
                                             "round, seconds", buckets=ROUND_BUCKETS, registry=r)
        self.allreduce_seconds = Histogram("peerd_allreduce_seconds", "All-reduce of an outer round, seconds",
                                           buckets=ALLREDUCE_BUCKETS, registry=r)
        self.outer_rounds = Counter("peerd_outer_rounds", "Outer rounds completed", registry=r)
        self.failed_rounds = Counter("peerd_failed_rounds", "Outer rounds that failed (theta_outer unchanged)",
                                     registry=r)
        self.bans = Counter("peerd_bans", "Peers banned for misbehaving", registry=r)
        self.outer_round = Gauge("peerd_outer_round", "Current outer round (theta_outer version)", registry=r)
        self.loss = Gauge("peerd_loss", "Training loss of the last inner step, nats per byte", registry=r)
        self.eval_loss = Gauge("peerd_eval_loss", "Held-out loss after the last outer round, nats per byte",
                               registry=r)
        self.tokens_per_second = Gauge("peerd_tokens_per_second", "Training throughput of the last inner steps",
                                       registry=r)
        self.group_size = Gauge("peerd_group_size", "Peers in the last outer round's group", registry=r)
        self.peers_seen = Gauge("peerd_peers_seen", "Live peers of the run in the last status read (this one "
                                "included)", registry=r)
        self.paused = Gauge("peerd_paused", "1 while this peer is paused (volunteer or active hours)", registry=r)
        # SWARM runs, per pipeline stage
        self.stage = Gauge("peerd_stage", "Pipeline stage this peer serves (SWARM runs)", registry=r)
        self.stage_rounds = Counter("peerd_stage_rounds", "Outer rounds of a stage's replicas completed",
                                    ["stage"], registry=r)
        self.stage_round_bytes = Counter("peerd_stage_round_bytes", "Bytes sent in a stage's outer rounds",
                                         ["stage"], registry=r)
        self.stage_moves = Counter("peerd_stage_moves", "Moves to the bottleneck stage (rebalancing)",
                                   ["from_stage", "to_stage"], registry=r)
        self.micro_batches = Gauge("peerd_swarm_micro_batches", "A SWARM trainer's micro-batches so far, by outcome "
                                   "(sent = completed + dropped; retried: calls re-sent to a replica)", ["outcome"],
                                   registry=r)
        r.register(_StreamCollector(stream_report))
        self._server = None

    def observe(self, event: "Event | Mapping[str, Any]") -> None:
        """Update from one event (an :class:`peerd.events.Event`, or its fields as its log line carries them)."""
        event = event_fields(event)
        kind = event.get("event")

        def num(key: str) -> Optional[float]:
            value = event.get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        if num("outer_round") is not None and kind in ("outer_round", "eval", "state_download", "resume"):
            self.outer_round.set(num("outer_round"))
        if kind == "inner":
            if num("loss") is not None:
                self.loss.set(num("loss"))
            if num("tokens_per_s") is not None:
                self.tokens_per_second.set(num("tokens_per_s"))
        elif kind == "outer_round":
            self.outer_rounds.inc()
            if num("round_s") is not None:
                self.outer_round_seconds.observe(num("round_s"))
            if num("allreduce_s") is not None:
                self.allreduce_seconds.observe(num("allreduce_s"))
            if num("group_size") is not None:
                self.group_size.set(num("group_size"))
        elif kind == "round_failed":
            self.failed_rounds.inc()
        elif kind == "ban":
            self.bans.inc()
        elif kind == "paused":
            self.paused.set(1)
        elif kind == "resumed":
            self.paused.set(0)
        elif kind == "stage_round" and num("stage") is not None:
            stage = str(int(num("stage")))
            self.stage.set(num("stage"))
            self.stage_rounds.labels(stage).inc()
            self.stage_round_bytes.labels(stage).inc(max(0.0, num("bytes_sent") or 0.0))
        elif kind == "stage_moved" and num("old_stage") is not None and num("new_stage") is not None:
            self.stage.set(num("new_stage"))
            self.stage_moves.labels(str(int(num("old_stage"))), str(int(num("new_stage")))).inc()
        elif kind == "swarm_progress":
            for outcome in ("sent", "completed", "retried", "dropped"):
                if num(outcome) is not None:
                    self.micro_batches.labels(outcome).set(num(outcome))
        if kind in ("eval", "outer_round") and num("eval_nats_per_byte") is not None:
            self.eval_loss.set(num("eval_nats_per_byte"))

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` in a background thread; returns the bound port (for port 0)."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
