"""An in-process transport: many peers in one event loop, for fast tests and simulations of large swarms.

A :class:`Hub` stands for the network: a shared discovery table and a registry of stream handlers. Streams are
in-memory pipes built on :class:`asyncio.StreamReader`, so protocol code runs unchanged. :meth:`Hub.disconnect` makes
a peer vanish (its streams fail, opening streams to it raises ``ConnectionError``), which is how tests kill a peer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from protocols.interfaces import Record, StreamHandler


class PipeWriter:
    """Writes into the peer's reader; ``close`` ends the peer's stream."""

    def __init__(self, target: asyncio.StreamReader, hub: "Hub", owner: str, remote: str):
        self._target = target
        self._hub = hub
        self._owner = owner
        self._remote = remote
        self._closed = False

    def write(self, data: bytes) -> None:
        if self._closed or not self._hub.connected(self._owner, self._remote):
            raise ConnectionResetError(f"stream {self._owner} -> {self._remote} is closed")
        self._target.feed_data(data)  # feed_data copies (extend): no copy of our own

    async def drain(self) -> None:
        if not self._hub.connected(self._owner, self._remote):
            raise ConnectionResetError(f"stream {self._owner} -> {self._remote} is closed")
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self._target.at_eof():
                self._target.feed_eof()


@dataclass
class Hub:
    """The shared medium of in-process peers."""

    _records: dict[str, dict[str, Record]] = field(default_factory=dict)
    _handlers: dict[str, dict[str, StreamHandler]] = field(default_factory=dict)
    _down: set[str] = field(default_factory=set)
    _streams: dict[str, list[tuple[PipeWriter, PipeWriter]]] = field(default_factory=dict)

    def transport(self, peer_id: str) -> "InProcessTransport":
        """A transport for a new peer named ``peer_id``."""
        self._handlers.setdefault(peer_id, {})
        self._down.discard(peer_id)
        return InProcessTransport(InProcessDiscovery(self), InProcessStreams(self, peer_id))

    def connected(self, a: str, b: str) -> bool:
        return a not in self._down and b not in self._down

    def disconnect(self, peer_id: str) -> None:
        """Make ``peer_id`` unreachable and end every stream it takes part in (a crash, as others see it).

        The crashed peer's own streams fail at once, bytes received but not yet read included (a dead process
        reads nothing more); the others see the end of the stream after what it had sent.
        """
        self._down.add(peer_id)
        for writer_a, writer_b in self._streams.pop(peer_id, []):
            for writer in (writer_a, writer_b):
                if writer._remote == peer_id:
                    writer._target.set_exception(ConnectionResetError(f"{peer_id} is down"))
            writer_a.close()
            writer_b.close()


class InProcessDiscovery:
    """Discovery over the hub's table; the clock is the wall clock."""

    def __init__(self, hub: Hub):
        self._hub = hub

    def time(self) -> float:
        return time.time()

    async def store(self, key: str, subkey: str, value: Any, expiration_time: float) -> bool:
        await asyncio.sleep(0)
        entries = self._hub._records.setdefault(key, {})
        current = entries.get(subkey)
        if current is not None and current.expiration_time > expiration_time:
            return False
        entries[subkey] = Record(value, expiration_time)
        return True

    async def get(self, key: str) -> dict[str, Record]:
        await asyncio.sleep(0)
        now = self.time()
        return {k: r for k, r in self._hub._records.get(key, {}).items() if r.expiration_time > now}


class InProcessStreams:
    """Peer streams as in-memory pipes between handlers registered on the hub."""

    def __init__(self, hub: Hub, peer_id: str):
        self._hub = hub
        self._peer_id = peer_id
        self._tasks: set[asyncio.Task] = set()

    @property
    def peer_id(self) -> str:
        return self._peer_id

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        handlers = self._hub._handlers[self._peer_id]
        if name in handlers:
            raise ValueError(f"handler {name!r} is already served")
        handlers[name] = handler

    async def remove_handler(self, name: str) -> None:
        self._hub._handlers.get(self._peer_id, {}).pop(name, None)

    writer_class = PipeWriter
    """Each direction's writer: ``writer_class(reader it feeds, hub, owner PeerID, remote PeerID)``."""

    async def _opening(self, peer_id: str) -> None:
        """What opening a stream to ``peer_id`` costs before it exists: one event-loop turn here."""
        await asyncio.sleep(0)

    async def open(self, peer_id: str, name: str) -> tuple[asyncio.StreamReader, PipeWriter]:
        await self._opening(peer_id)
        handler = self._hub._handlers.get(peer_id, {}).get(name)
        if handler is None or not self._hub.connected(self._peer_id, peer_id):
            raise ConnectionRefusedError(f"{peer_id} does not serve {name!r}")
        local_reader, remote_reader = asyncio.StreamReader(), asyncio.StreamReader()
        local_writer = self.writer_class(remote_reader, self._hub, self._peer_id, peer_id)
        remote_writer = self.writer_class(local_reader, self._hub, peer_id, self._peer_id)
        for peer in (self._peer_id, peer_id):
            self._hub._streams.setdefault(peer, []).append((local_writer, remote_writer))

        async def serve() -> None:
            try:
                await handler(self._peer_id, remote_reader, remote_writer)
            finally:
                remote_writer.close()

        task = asyncio.ensure_future(serve())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return local_reader, local_writer


@dataclass
class InProcessTransport:
    """Discovery plus streams of one in-process peer."""

    discovery: InProcessDiscovery
    streams: InProcessStreams
