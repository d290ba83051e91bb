"""The few things the protocols need from a network, as structural interfaces.

``peerd.transport`` implements them on hivemind (DHT + p2pd streams) and in-process (for fast tests and
simulations of many peers). Protocol runners receive an implementation; they never construct one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Optional, Protocol, runtime_checkable


@dataclass(frozen=True)
class Record:
    """One value found in discovery under ``(key, subkey)``.

    ``expiration_time`` is in discovery-time seconds (see :meth:`Discovery.time`).
    """

    value: Any
    expiration_time: float


@runtime_checkable
class Discovery(Protocol):
    """A key-value store with expiration shared by all peers (a DHT).

    Values are msgpack-serializable (dict, list, str, bytes, int, float, bool, None). A key holds a dictionary of
    subkeys, each with its own value and expiration; a newer expiration for the same subkey replaces the older one.
    """

    def time(self) -> float:
        """Current discovery time in seconds (comparable with ``expiration_time`` across peers)."""

    async def store(self, key: str, subkey: str, value: Any, expiration_time: float) -> bool:
        """Store ``value`` under ``(key, subkey)`` until ``expiration_time``; True if some node accepted it."""

    async def get(self, key: str) -> dict[str, Record]:
        """All unexpired subkeys of ``key`` (empty if none). Never raises on a missing key."""


class StreamReader(Protocol):
    """The subset of :class:`asyncio.StreamReader` the protocols use."""

    async def readexactly(self, n: int) -> bytes: ...


class StreamWriter(Protocol):
    """The subset of :class:`asyncio.StreamWriter` the protocols use."""

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


#: ``handler(remote_peer_id, reader, writer)``: serves one incoming stream; the transport closes it afterwards (where
#: closing first could drop the handler's last answer, as on p2pd, only once the remote closed or a bounded wait ran
#: out). Protocols register handlers through :class:`protocols.rpc.Service`, not directly.
StreamHandler = Callable[[str, StreamReader, StreamWriter], Awaitable[None]]


@runtime_checkable
class PeerStreams(Protocol):
    """Bidirectional byte streams between peers, addressed by PeerID (base58 string) and a handler name."""

    @property
    def peer_id(self) -> str:
        """This peer's PeerID (base58)."""

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        """Serve incoming streams opened with ``name``. Raises ``ValueError`` if ``name`` is already served."""

    async def remove_handler(self, name: str) -> None:
        """Stop serving ``name`` (no-op if not served)."""

    async def open(self, peer_id: str, name: str) -> tuple[StreamReader, StreamWriter]:
        """Open a stream to ``peer_id``'s handler ``name``. Raises ``ConnectionError`` if that is impossible."""


class UplinkLease(Protocol):
    """One run's shares of the uplink, from :meth:`UplinkPacing.pace_uplink`."""

    def release(self, peer_id: str) -> None:
        """All we send to ``peer_id`` this run was handed over: its share goes to the peers still being sent to."""

    def close(self) -> None:
        """The run is over: its connections are unpaced again (idempotent)."""


class UplinkPacing(Protocol):
    """What :class:`PeerStreams` may offer besides (duck-typed: look it up with ``getattr``): pacing this peer's
    connections at shares of its uplink, where the uplink's rate is known."""

    def pace_uplink(self, shares: Mapping[str, float]) -> Optional[UplinkLease]:
        """Pace what we send to each PeerID of ``shares`` at that fraction ([0, 1]) of our uplink, streams opened
        later included, until the lease is closed; None where the rate is unknown or the connections cannot be
        paced (nothing changed)."""


@runtime_checkable
class Transport(Protocol):
    """What a peer's runners are handed: discovery plus peer streams."""

    discovery: Discovery
    streams: PeerStreams
