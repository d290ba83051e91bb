"""Logging setup: human-readable lines or JSON lines on stderr.

Typed events (:mod:`peerd.events`) are logged with ``extra={"event": ..., ...}``: the JSON formatter writes those
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


class TextFormatter(logging.Formatter):
    """``HH:MM:SS LEVEL logger: message``, one line per record: a message with line breaks (go-libp2p's dial errors
    list one failed address per line) is joined with ``; `` so that every line of the log has its time and level.
    A traceback (``exc_info``) keeps its lines. Levels have their standard names (hivemind renames WARNING)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.levelname = _LEVELS.get(record.levelno, record.levelname)
        if "\n" in record.message:
            record.message = "; ".join(part.strip(" *\t") for part in record.message.splitlines() if part.strip())
        return super().formatMessage(record)


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


#: Values of ``--log-format``: ``text`` for people, ``json`` (one object per line) for log shippers.
LOG_FORMATS = ("text", "json")


def setup_logging(log_format: str = "text", level: str | None = None) -> None:
    """Configure the root logger on stderr in ``log_format`` (:data:`LOG_FORMATS`). Level from ``level`` or
    ``PEERD_LOGLEVEL`` (default INFO). Raises ValueError for an unknown format."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    level = (level or os.environ.get("PEERD_LOGLEVEL") or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # hivemind installs its own handler on its loggers; keep its chatter below ours
    for name in ("hivemind",):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    logging.captureWarnings(True)
