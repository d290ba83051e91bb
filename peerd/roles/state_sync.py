"""Serving this peer's state to joiners and downloading a state from peers ahead: one helper every role reuses.

The server answers with the latest :class:`StateSnapshot` that ``snapshot()`` returns; a download tries peers in
order and returns the first snapshot that ``validate`` accepts. Each download from one peer is bounded by the run's
``[averaging.state_transfer] download_timeout_s``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Generic, Optional, Sequence, TypeVar

from protocols.interfaces import Transport
from protocols.state_transfer import StateServer, StateSnapshot, StateTransferFailed, download_state
from protocols.wire import ProtocolViolation

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Downloaded(Generic[T]):
    """A validated state, where it came from, its payload size (bytes) and the download time (seconds)."""

    state: T
    peer: str
    payload_bytes: int
    seconds: float


class StateSync:
    """``prefix``: the role's handler prefix; ``timeout_s``: bound of one download (seconds)."""

    def __init__(self, transport: Transport, prefix: str, snapshot: Callable[[], StateSnapshot], timeout_s: float):
        self.transport = transport
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.server = StateServer(transport, prefix, snapshot)

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()

    async def download_first(self, peers: Sequence[str], max_bytes: int,
                             validate: Callable[[StateSnapshot], T]) -> Optional[Downloaded[T]]:
        """The first of ``peers`` whose snapshot (at most ``max_bytes`` of payload) ``validate`` accepts; None if
        none did. ``validate`` raises ProtocolViolation, ValueError or TypeError to refuse one."""
        for peer in peers:
            started = time.perf_counter()
            try:
                snapshot = await download_state(self.transport, self.prefix, peer, max_bytes, self.timeout_s)
                state = validate(snapshot)
            except (StateTransferFailed, ProtocolViolation, ValueError, TypeError) as e:
                logger.warning("state download from %s failed: %s", peer, e)
                continue
            return Downloaded(state, peer, len(snapshot.payload), time.perf_counter() - started)
        return None
