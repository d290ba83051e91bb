"""Logging setup (human-readable or JSON lines) and the status records peers keep in the DHT.

Structured events are ordinary log records with ``extra={"event": ..., ...}``: the JSON formatter writes those
fields as keys, so tests and log shippers read them without parsing prose.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

# hivemind renames WARNING to WARN process-wide; log shippers expect the standard names
_LEVELS = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR",
           logging.CRITICAL: "CRITICAL"}
_STANDARD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, plus every ``extra`` field."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": round(record.created, 3),
            "level": _LEVELS.get(record.levelno, record.levelname),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(log_format: str = "text", level: str | None = None) -> None:
    """Configure the root logger on stderr. Level from ``level`` or ``PEERD_LOGLEVEL`` (default INFO)."""
    level = (level or os.environ.get("PEERD_LOGLEVEL") or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # hivemind installs its own handler on its loggers; keep its chatter below ours
    for name in ("hivemind",):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    logging.captureWarnings(True)


def event_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra`` fields of a record (``event`` and the rest), as the JSON formatter writes them."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS and not k.startswith("_")}


class EventTap(logging.Handler):
    """Hands every structured event (a record with ``extra={"event": ...}``) to subscribers: metrics, the daemon's
    own state, systemd status lines. Attach it to the ``peerd`` logger with :meth:`attach`."""

    def __init__(self, *subscribers: Any):
        super().__init__(logging.DEBUG)
        self.subscribers = list(subscribers)
        self._restore: list[tuple[Any, int]] = []
        self._failed: set[int] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(getattr(record, "event", None), str):
            return
        event = event_fields(record)
        for subscriber in self.subscribers:
            try:
                subscriber(event)
            except Exception:  # never let a subscriber break logging; say so once, not on every event
                if id(subscriber) not in self._failed:
                    self._failed.add(id(subscriber))
                    logging.getLogger(__name__).warning("event subscriber %r failed", subscriber, exc_info=True)

    def attach(self, logger_name: str = "peerd") -> None:
        """Receive INFO events even when the user asked for fewer log lines: the ``peerd`` logger lets INFO through
        and the root handlers keep the user's level."""
        root = logging.getLogger()
        target = logging.getLogger(logger_name)
        if target.getEffectiveLevel() > logging.INFO:
            for handler in root.handlers:
                if handler.level < root.level:
                    self._restore.append((handler, handler.level))
                    handler.setLevel(root.level)
            self._restore.append((target, target.level))
            target.setLevel(logging.INFO)
        target.addHandler(self)
        self._target = target

    def detach(self) -> None:
        target = getattr(self, "_target", None)
        if target is not None:
            target.removeHandler(self)
        for obj, level in reversed(self._restore):
            obj.setLevel(level)
        self._restore.clear()


def status_key(run_id: str) -> str:
    """Deprecated: use ``RunNamespace.of(run_id).status_key`` (:mod:`peerd.namespace`). Keyed by the run name."""
    from peerd.namespace import RunNamespace

    return RunNamespace.of(run_id).status_key


def config_key(run_id: str) -> str:
    """Deprecated: use ``RunNamespace.of(run_id).config_key`` (:mod:`peerd.namespace`). Keyed by the run name."""
    from peerd.namespace import RunNamespace

    return RunNamespace.of(run_id).config_key


STATUS_FIELDS = ("role", "outer_round", "inner_step", "loss", "tokens_per_s", "eval_nats_per_byte", "digest")


def make_status(**fields: Any) -> dict[str, Any]:
    """A status record: the known fields (missing ones None) plus the time it was made."""
    unknown = set(fields) - set(STATUS_FIELDS)
    if unknown:
        raise ValueError(f"unknown status fields {sorted(unknown)}")
    record = {name: fields.get(name) for name in STATUS_FIELDS}
    record["time"] = time.time()
    return record


#: Bounds of a status record (the DHT carries them to every peer of the run; a reader trusts none of them blindly).
_STATUS_INTS = ("outer_round", "inner_step")
_STATUS_FLOATS = ("loss", "tokens_per_s", "eval_nats_per_byte")
_MAX_ROUND = 2**40


def status_problem(record: Any) -> str | None:
    """None if ``record`` has the schema of :func:`make_status`, else what is wrong (a reader drops such records).

    Checks: a dict with exactly the status fields and ``time``; ``role`` a short string; ``outer_round`` and
    ``inner_step`` non-negative integers (or None); loss, tokens/s and eval finite numbers (or None); ``digest`` a
    short string (or None); ``time`` a finite number.
    """
    if not isinstance(record, dict):
        return f"not a record but {type(record).__name__}"
    if set(record) != set(STATUS_FIELDS) | {"time"}:
        return f"fields {sorted(map(str, record))} are not the status fields"
    if not isinstance(record["role"], str) or not 0 < len(record["role"]) <= 32:
        return "role is not a short string"
    for name in _STATUS_INTS:
        value = record[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_ROUND):
            return f"{name} is not a non-negative integer: {value!r}"
    for name in _STATUS_FLOATS + ("time",):
        value = record[name]
        if value is None and name != "time":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
            return f"{name} is not a finite number: {value!r}"
    digest = record["digest"]
    if digest is not None and (not isinstance(digest, str) or len(digest) > 64):
        return "digest is not a short string"
    return None


class StatusFilter:
    """Keeps the status records that have the right schema (:func:`status_problem`); logs each bad one once."""

    def __init__(self, log: logging.Logger | None = None):
        self.log = log or logging.getLogger(__name__)
        self.dropped = 0
        self._logged: set[tuple[str, str]] = set()

    def __call__(self, records: dict[str, Any]) -> dict[str, dict]:
        """PeerID -> status value (``records`` maps PeerIDs to :class:`protocols.interfaces.Record` or values)."""
        out = {}
        for peer, record in records.items():
            value = getattr(record, "value", record)
            problem = status_problem(value)
            if problem is None:
                out[peer] = value
                continue
            self.dropped += 1
            if (peer, problem) not in self._logged and len(self._logged) < 4096:
                self._logged.add((peer, problem))
                self.log.warning("dropped the status record of %s: %s", peer, problem,
                                 extra={"event": "status_refused", "peer": peer, "reason": problem})
        return out
