"""The counters a training worker reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class RoundStats:
    """Counters a worker reports (status records, events, the demo's summary): rounds, bytes, tokens trained, the
    latest training loss and held-out loss (nats/byte) and the inner loop's throughput (tokens/s)."""

    rounds_ok: int = 0
    rounds_failed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    tokens: int = 0
    last_loss: Optional[float] = None
    last_eval: Optional[float] = None
    tokens_per_s: Optional[float] = None
