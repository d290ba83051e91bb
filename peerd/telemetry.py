"""Logging setup (human-readable or JSON lines) and the status records peers keep in the DHT.

Structured events (:mod:`peerd.events`) are logged with ``extra={"event": ..., ...}``: the JSON formatter writes
those fields as keys, so tests and log shippers read them without parsing prose.
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


def status_key(run_id: str) -> str:
    """DHT key under which every peer of ``run_id`` keeps its status record (subkey = PeerID)."""
    return f"peerd.{run_id}.status"


def config_key(run_id: str) -> str:
    """DHT key of the run's published configuration."""
    return f"peerd.{run_id}.config"


STATUS_FIELDS = ("role", "outer_round", "inner_step", "loss", "tokens_per_s", "eval_nats_per_byte", "digest",
                 "instance")
#: Fields a record may lack (written by peers that predate them); a reader sees them as None.
OPTIONAL_STATUS_FIELDS = ("instance",)


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
    short string (or None); ``instance`` (optional) a short string or None; ``time`` a finite number.
    """
    if not isinstance(record, dict):
        return f"not a record but {type(record).__name__}"
    if not set(STATUS_FIELDS) - set(OPTIONAL_STATUS_FIELDS) <= set(record) <= set(STATUS_FIELDS) | {"time"}:
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
    for name in ("digest", "instance"):
        value = record.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > 64):
            return f"{name} is not a short string"
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
