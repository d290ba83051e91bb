"""Logging setup (human-readable or JSON lines) and structured events. The status records peers keep in the DHT
are in :mod:`peerd.status` (re-exported here).

Structured events are ordinary log records with ``extra={"event": ..., ...}``: the JSON formatter writes those
fields as keys, so tests and log shippers read them without parsing prose.
"""

from __future__ import annotations

import json
import logging
import os
import sys
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


# Status records moved to peerd.status; re-exported for the code that imports them from here.
from peerd.status import (  # noqa: E402,F401
    KNOWN_STATUS_FIELDS,
    OPTIONAL_STATUS_FIELDS,
    STATUS_FIELDS,
    STATUS_VERSION,
    StatusFilter,
    make_status,
    status_problem,
)
