"""A direct TCP data plane for bulk peer streams, encrypted with TLS 1.3 bound to the peers' PeerIDs; p2pd as fallback.

Every byte of a libp2p stream crosses two unix sockets and the TLS/yamux layers of two Go daemons (p2pd), which caps
one stream at a few hundred MB/s and costs CPU in both daemons. :class:`DirectStreams` wraps the transport's
:class:`protocols.interfaces.PeerStreams` and moves streams onto TCP between the two Python processes instead:

- ``start()`` listens on ``host:port`` and publishes ``{"host", "port"}`` under :data:`DATAPLANE_KEY`, subkey = our
  PeerID, re-published every :data:`REPUBLISH_INTERVAL_S` (or, with ``publish=False``, only once
  :meth:`DirectStreams.set_dialable` says others can dial us: the daemon waits for the dial-back check's verdict,
  so that nobody waits for a connect to a peer behind a NAT; an empty record withdraws the address). Through the
  daemon's :class:`peerd.transport.records.SignedDiscovery` the record is signed by its owner, so nobody can point
  another peer's address elsewhere. (A wrong address alone gets nobody a stream: the handshake fails there and the
  stream falls back to p2pd.)
- ``add_handler`` serves a name on both the inner streams and the direct listener; ``open`` looks the peer's
  address up (one DHT read returns every peer's address; cached), connects and runs the handshake; if the peer has no
  address, cannot be reached or fails the handshake, it falls back to ``inner.open`` (logged once per peer).

**Security.** Every connection is TLS 1.3 (OpenSSL through Python's ``ssl``) between certificates bound to the
peers' Ed25519 identity keys as in the libp2p TLS specification (:mod:`peerd.transport.tls`); the handshake
(:mod:`peerd.transport.handshake`) checks that the server is the PeerID we dial and tells the server which PeerID
dialled. Every byte after it is encrypted and integrity-protected: an on-path attacker can read nothing and alter
nothing (an altered byte ends the connection: the stream fails, like a dropped connection, and nothing altered
reaches a handler), replayed or reflected handshakes fail, and there is no plaintext mode to downgrade to. An
on-path attacker can still drop or cut connections (then the stream fails or falls back to p2pd), as on any network.
The handler receives the *authenticated* client PeerID, exactly as with p2pd streams. The DHT and everything else
hivemind does stay on libp2p.

Layering in the daemon: HivemindTransport -> SignedDiscovery -> DirectStreams -> pacing -> admission; attributes this
class does not define are looked up on the inner streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import time
from collections import Counter
from typing import Any, Optional

from peerd.identity.namespace import network_key
from peerd.identity.signing import Signer
from peerd.transport.connection import (SOCKET_BUFFER_BYTES, Connection, SendCounters, open_connection,
                                        send_counters, set_pacing, tune)
from peerd.transport.handshake import (HandshakeFailed, HandshakeRefused, client_handshake,  # noqa: F401 - re-exported
                                       server_handshake)
from peerd.transport.linger import serve_stream
from peerd.transport.mux import MUX_NAME, MuxSession, MuxStream
from peerd.transport.tls import PeerTLS
from protocols.interfaces import Discovery, PeerStreams, StreamHandler
from protocols.wire import ProtocolViolation

logger = logging.getLogger(__name__)

#: DHT key of the data plane addresses; subkey = the owner's PeerID, value = ``{"host": str, "port": int}``.
DATAPLANE_KEY = network_key("dataplane")  # "peerd.dataplane": one key for the whole network, not per run

#: Our address record lives this long in the DHT and is re-published this often (seconds).
RECORD_TTL_S = 300.0
REPUBLISH_INTERVAL_S = 60.0
#: A peer's cached address is used without a new DHT read for this long, then refreshed in the background (s).
ADDRESS_TTL_S = 120.0
#: A peer missing from the table triggers a new DHT read at most this often (seconds).
LOOKUP_RETRY_S = 15.0
#: Longest wait for one DHT read of the table (seconds).
LOOKUP_TIMEOUT_S = 5.0
#: TCP connect plus client handshake, and the server's whole handshake (seconds).
CONNECT_TIMEOUT_S = 5.0
HANDSHAKE_TIMEOUT_S = 5.0
#: After a failed connect or handshake, a peer's address is skipped (p2pd is used) for this long (seconds).
UNREACHABLE_RETRY_S = 60.0
#: Connections that have not finished the handshake yet; more are closed at once.
MAX_PENDING_HANDSHAKES = 64
#: Distinct peers / remote hosts remembered for log-once messages.
_LOGGED_MAX = 4096
#: With ``multiplex``, the peer with the larger PeerID waits this long for the other's connection before dialling
#: one itself, so that two peers opening streams to each other at once end up with one connection, not two (s).
DIAL_GRACE_S = 0.2


def _valid_address(value: Any) -> Optional[tuple[str, int]]:
    if not isinstance(value, dict):
        return None
    host, port = value.get("host"), value.get("port")
    if not isinstance(host, str) or not 0 < len(host) <= 255 or host in ("0.0.0.0", "::"):
        return None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    return host, port


# -------------------------------------------------------------------------------------------------- DirectStreams


class DirectStreams:
    """:class:`protocols.interfaces.PeerStreams` over authenticated direct TCP, falling back to ``inner``.

    ``host``/``port``: where to listen (port 0 = any free port); ``announce_host``: the host others should dial
    (default ``host``; required if ``host`` is a wildcard). ``signer`` must hold the key of ``inner.peer_id``.
    ``key``: the DHT key of the address table; ``socket_buffer_bytes``: see :data:`SOCKET_BUFFER_BYTES`.
    Streams are TLS 1.3 with a certificate made at :meth:`start` (:mod:`peerd.transport.tls`).
    ``multiplex``: carry every stream to a peer over one long-lived connection (:mod:`peerd.transport.mux`), dialled
    once and reused across rounds (re-dialled if it drops), instead of one connection per stream.
    ``publish``: publish our address at :meth:`start`; False = only once :meth:`set_dialable` says others can dial
    us (until then peers open their streams to us through ``inner``, and ours to them go direct where they
    published). Before :meth:`start` and after :meth:`stop`, every stream goes through ``inner``. ``stats`` counts
    direct and fallback opens, direct streams served, refused handshakes, and TCP connections dialled
    (``tcp_dials``).
    """

    def __init__(self, inner: PeerStreams, discovery: Discovery, signer: Signer, host: str, port: int = 0,
                 announce_host: Optional[str] = None, *, key: str = DATAPLANE_KEY,
                 socket_buffer_bytes: int = SOCKET_BUFFER_BYTES, multiplex: bool = False, publish: bool = True):
        if signer.peer_id != inner.peer_id:
            raise ValueError(f"the signer's key is {signer.peer_id}'s, but the streams are {inner.peer_id}'s")
        announce = announce_host or host
        if announce in ("", "0.0.0.0", "::"):
            raise ValueError(f"listening on {host!r} needs an announce_host others can dial")
        self._inner = inner
        self.discovery = discovery
        self.signer = signer
        self.host, self.port, self.announce_host = host, port, announce
        self.key = key
        self.socket_buffer_bytes = socket_buffer_bytes
        self.publishing = publish
        self._handlers: dict[str, StreamHandler] = {}
        self._server: Optional[asyncio.AbstractServer] = None
        self._republisher: Optional[asyncio.Task] = None
        self._connections: set[asyncio.Task] = set()
        self._pending_handshakes = 0
        self._addresses: dict[str, tuple[tuple[str, int], float]] = {}  # PeerID -> (address, record expiration)
        self._looked_up_at = -float("inf")  # monotonic time of the last completed table read
        self._lookup: Optional[asyncio.Task] = None
        self._unreachable: dict[str, tuple[tuple[str, int], float]] = {}  # PeerID -> (address, monotonic until)
        self._logged_fallback: set[str] = set()
        self._logged_refusal: set[tuple[str, str]] = set()
        self.stats: Counter[str] = Counter()
        self.multiplex = multiplex
        self._mux: dict[str, MuxSession] = {}  # PeerID -> the connection our streams to it use
        self._mux_all: set[MuxSession] = set()
        self._dialing: dict[str, asyncio.Task] = {}
        self._mux_arrived: dict[str, asyncio.Event] = {}
        self._paces: dict[str, float] = {}  # PeerID -> bytes/s its connections are paced at (pace())
        self.tls: Optional[PeerTLS] = None  # our certificate and TLS contexts, from start() to stop()

    @property
    def peer_id(self) -> str:
        return self._inner.peer_id

    @property
    def inner(self) -> PeerStreams:
        """The streams this class falls back to (p2pd in the daemon)."""
        return self._inner

    @property
    def listening(self) -> Optional[tuple[str, int]]:
        """``(announce_host, port)`` while the direct listener runs, else None."""
        return (self.announce_host, self.port) if self._server is not None else None

    # ------------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Listen and publish our address (awaits the first store; a failed store is retried periodically)."""
        if self._server is not None:
            return
        loop = asyncio.get_running_loop()
        if self.tls is None:
            self.tls = PeerTLS(self.signer)
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune(sock, self.socket_buffer_bytes)  # accepted sockets inherit the listener's buffers
            sock.bind(sockaddr)
            sock.setblocking(False)
            self._server = await loop.create_server(lambda: Connection(self._accepted), sock=sock,
                                                    backlog=MAX_PENDING_HANDSHAKES)
        except BaseException:
            sock.close()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        if self.publishing:
            try:
                await self._publish()
            except BaseException:
                await self.stop()
                raise
            self._republisher = asyncio.ensure_future(self._republish_forever())
        logger.info("direct data plane on %s:%d", self.announce_host, self.port,
                    extra={"event": "dataplane_listening", "host": self.announce_host, "port": self.port})

    async def stop(self) -> None:
        """Stop listening and end every direct stream (handlers stay registered on the inner streams)."""
        server, self._server = self._server, None
        for session in list(self._mux_all):
            session.close()
        self._mux.clear()
        for task in [self._republisher, self._lookup, *self._connections, *self._dialing.values()]:
            if task is not None:
                task.cancel()
        if server is not None:
            server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), HANDSHAKE_TIMEOUT_S)
        tasks = [t for t in [self._republisher, *self._connections] if t is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=HANDSHAKE_TIMEOUT_S)
        self._republisher = None
        if self.tls is not None:
            self.tls.close()
            self.tls = None

    async def set_dialable(self, dialable: bool) -> None:
        """Publish our address (``dialable``: others can dial us, e.g. the dial-back check said so) or withdraw it
        (an empty record replaces it: peers that read the table again open their streams to us through ``inner``
        instead of waiting for a connect that cannot succeed). Only while started; a no-op if nothing changes."""
        if self._server is None or dialable == self.publishing:
            return
        self.publishing = dialable
        if self._republisher is not None:
            self._republisher.cancel()
            self._republisher = None
        await self._publish()
        if dialable:
            self._republisher = asyncio.ensure_future(self._republish_forever())
        logger.info("direct data plane address %s", "published" if dialable else "withdrawn",
                    extra={"event": "dataplane_published", "dialable": dialable})

    async def _publish(self) -> bool:
        expiration = self.discovery.time() + RECORD_TTL_S
        address = {"host": self.announce_host, "port": self.port} if self.publishing else {}
        try:
            ok = await asyncio.wait_for(
                self.discovery.store(self.key, self.peer_id, address, expiration), LOOKUP_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, OSError) as e:
            ok = False
            logger.info("could not publish the data plane address: %r", e)
        return bool(ok)

    async def _republish_forever(self) -> None:
        while True:
            await asyncio.sleep(REPUBLISH_INTERVAL_S)
            await self._publish()  # a failure is logged there; peers use p2pd meanwhile

    # --------------------------------------------------------------------------------------------------- serving

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        if name in self._handlers:
            raise ValueError(f"handler {name!r} is already served")
        await self._inner.add_handler(name, handler)
        self._handlers[name] = handler

    async def remove_handler(self, name: str) -> None:
        self._handlers.pop(name, None)
        await self._inner.remove_handler(name)

    def _accepted(self, conn: Connection) -> None:
        if self._server is None:
            conn.abort()
            return
        task = asyncio.ensure_future(self._serve(conn))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: Connection) -> None:
        """One incoming connection: handshake within HANDSHAKE_TIMEOUT_S, then the handler; always closed after.
        The connection is both the handler's reader and its writer."""
        reader = writer = conn
        remote = str((conn.get_extra_info("peername") or ("?",))[0])
        try:
            if self._pending_handshakes >= MAX_PENDING_HANDSHAKES:
                self._refused(remote, "too many pending handshakes")
                return
            self._pending_handshakes += 1
            try:
                client, name = await asyncio.wait_for(
                    server_handshake(conn, self.tls, self._serves), HANDSHAKE_TIMEOUT_S)
            except asyncio.TimeoutError:
                self._refused(remote, f"no handshake within {HANDSHAKE_TIMEOUT_S} s")
                return
            except (HandshakeFailed, ProtocolViolation, ConnectionError, OSError) as e:
                self._refused(remote, str(e))
                return
            except Exception as e:  # boundary: nothing a remote sends may crash the listener
                self._refused(remote, f"{type(e).__name__}: {e}")
                return
            finally:
                self._pending_handshakes -= 1
            if name == MUX_NAME:
                self.stats["mux_accepted"] += 1
                session = self._adopt(conn, client, dialer=False)
                await session.closed_event.wait()
                return
            handler = self._handlers.get(name)
            if handler is None:  # removed during the handshake
                return
            self.stats["served_direct"] += 1
            await serve_stream(handler, client, reader, writer, f"{name} (direct)")
        finally:
            writer.close()

    def _serves(self, name: str) -> bool:
        return name in self._handlers or (self.multiplex and name == MUX_NAME)

    def _adopt(self, conn: Connection, peer: str, dialer: bool) -> MuxSession:
        """Serve and use the multiplexed connection ``conn`` to ``peer``: our streams to it go there unless one is
        already in use."""
        session = MuxSession(conn, peer, dialer, self._handlers.__contains__,
                             lambda name, stream: self._serve_mux_stream(peer, name, stream))
        self._mux_all.add(session)
        if peer in self._paces:
            self._set_pace(session, self._paces[peer])
        current = self._mux.get(peer)
        if current is None or current.closed:
            self._mux[peer] = session
        arrived = self._mux_arrived.pop(peer, None)
        if arrived is not None:
            arrived.set()

        def ended(_: Any) -> None:
            self._mux_all.discard(session)
            if self._mux.get(peer) is session:
                del self._mux[peer]

        asyncio.ensure_future(session.closed_event.wait()).add_done_callback(ended)
        return session

    @property
    def can_pace(self) -> bool:
        """Whether :meth:`pace` paces anything here: multiplexed connections on Linux."""
        return self.multiplex and sys.platform.startswith("linux")

    def pace(self, peer_id: str, bytes_per_s: Optional[float]) -> bool:
        """Pace what we send on the multiplexed connections to ``peer_id`` at ``bytes_per_s`` (None: unpaced again),
        as :func:`peerd.transport.connection.set_pacing` does: the connections open now and any opened to it later
        (dialled again after a drop, or dialled by the peer), until paced otherwise. Returns False where the system
        does not pace (not Linux) or this instance does not multiplex (streams on connections of their own are
        not paced), True otherwise. Streams that go through the inner (p2pd) streams are not paced."""
        if not self.can_pace:
            return False
        if bytes_per_s is None:
            self._paces.pop(peer_id, None)
        else:
            self._paces[peer_id] = bytes_per_s
        for session in self._open_sessions(peer_id):
            self._set_pace(session, bytes_per_s)
        return True

    def send_counters(self, peer_id: str) -> dict[int, SendCounters]:
        """The kernel's counters of our sending (:func:`peerd.transport.connection.send_counters`) on each of our
        multiplexed connections to ``peer_id`` that is open now, keyed by an id that stays the connection's for its
        life (a connection dialled again is a new key, counting from its own start); {} where the system does not
        say. What :class:`peerd.transport.uplink.UplinkMeter` measures the uplink by."""
        counts = {}
        for session in self._open_sessions(peer_id):
            sock = session.conn.get_extra_info("socket")
            counters = send_counters(sock) if sock is not None else None
            if counters is not None:
                counts[id(session)] = counters
        return counts

    def _open_sessions(self, peer_id: str) -> list[MuxSession]:
        """Our multiplexed connections to ``peer_id`` that are open now (a list: pacing may not change the set)."""
        return [s for s in self._mux_all if s.peer == peer_id and not s.closed]

    @staticmethod
    def _set_pace(session: MuxSession, bytes_per_s: Optional[float]) -> None:
        sock = session.conn.get_extra_info("socket")
        if sock is not None:
            set_pacing(sock, bytes_per_s)

    def _serve_mux_stream(self, peer: str, name: str, stream: MuxStream) -> None:
        handler = self._handlers.get(name)
        if handler is None:
            stream.abort()
            return

        async def serve() -> None:
            self.stats["served_direct"] += 1
            try:
                await serve_stream(handler, peer, stream, stream, f"{name} (direct)")
            finally:
                stream.close()

        task = asyncio.ensure_future(serve())
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _mux_session(self, address: tuple[str, int], peer_id: str) -> MuxSession:
        """The live multiplexed connection to ``peer_id``: the current one, or one dialled now (one dial at a time
        per peer). Raises as :meth:`_open_direct`."""
        session = self._mux.get(peer_id)
        if session is not None and not session.closed:
            return session
        dialing = self._dialing.get(peer_id)
        if dialing is None:
            dialing = self._dialing[peer_id] = asyncio.ensure_future(self._dial_mux(address, peer_id))
            dialing.add_done_callback(lambda _: self._dialing.pop(peer_id, None))
        return await asyncio.shield(dialing)

    async def _dial_mux(self, address: tuple[str, int], peer_id: str) -> MuxSession:
        if self.peer_id > peer_id:  # the smaller PeerID dials first: two simultaneous opens share its connection
            arrived = self._mux_arrived.setdefault(peer_id, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(arrived.wait(), DIAL_GRACE_S)
            session = self._mux.get(peer_id)
            if session is not None and not session.closed:
                return session
        conn, _ = await self._open_direct(address, peer_id, MUX_NAME)
        self.stats["mux_dialled"] += 1
        return self._adopt(conn, peer_id, dialer=True)

    def _refused(self, remote: str, reason: str) -> None:
        self.stats["refused"] += 1
        kind = reason.split(":")[0][:60]
        if (remote, kind) in self._logged_refusal:
            return
        if len(self._logged_refusal) >= _LOGGED_MAX:
            self._logged_refusal.clear()
        self._logged_refusal.add((remote, kind))
        logger.warning("refused a direct connection from %s: %s", remote, reason[:200],
                       extra={"event": "direct_refused", "remote": remote, "reason": reason[:200]})

    # --------------------------------------------------------------------------------------------------- opening

    async def open(self, peer_id: str, name: str) -> tuple[Any, Any]:
        """A direct stream to ``peer_id``'s ``name`` if possible, else ``inner.open`` (ConnectionError if neither).
        With ``multiplex``, a live connection to the peer is used whoever dialled it: a peer that publishes no
        address (behind a NAT) is reached over the connection it dialled to us."""
        reason = "direct data plane stopped"
        if self._server is not None:
            session = self._mux.get(peer_id) if self.multiplex else None
            if session is not None and not session.closed:
                stream = session.open(name)
                self.stats["direct_opens"] += 1
                return stream, stream
            address = await self._address_of(peer_id)
            reason = "no data plane address"
            if address is not None:
                try:
                    if self.multiplex:
                        session = await asyncio.wait_for(self._mux_session(address, peer_id), CONNECT_TIMEOUT_S)
                        stream = session.open(name)
                        self.stats["direct_opens"] += 1
                        return stream, stream
                    streams = await asyncio.wait_for(self._open_direct(address, peer_id, name), CONNECT_TIMEOUT_S)
                    self.stats["direct_opens"] += 1
                    return streams
                except HandshakeRefused as e:
                    reason = str(e)
                    self.stats["direct_failed"] += 1
                    if e.code != "not_served":  # e.g. a stale address, now someone else's
                        self._mark_unreachable(peer_id, address)
                except (asyncio.TimeoutError, HandshakeFailed, ProtocolViolation, ConnectionError, OSError) as e:
                    reason = f"{address[0]}:{address[1]}: {type(e).__name__}: {e}"
                    self.stats["direct_failed"] += 1
                    self._mark_unreachable(peer_id, address)
        self._log_fallback(peer_id, reason)
        self.stats["fallback_opens"] += 1
        return await self._inner.open(peer_id, name)

    async def _open_direct(self, address: tuple[str, int], peer_id: str, name: str) -> tuple[Any, Any]:
        self.stats["tcp_dials"] += 1
        conn = await open_connection(*address, buffer_bytes=self.socket_buffer_bytes)
        try:
            await client_handshake(conn, self.tls, peer_id, name)
        except BaseException:
            conn.abort()
            raise
        return conn, conn

    async def _address_of(self, peer_id: str) -> Optional[tuple[str, int]]:
        now = time.monotonic()
        entry = self._addresses.get(peer_id)
        if entry is not None and entry[1] <= self.discovery.time():
            entry = None  # its record expired
        age = now - self._looked_up_at
        if entry is None and age > LOOKUP_RETRY_S:
            await self._refresh()
            entry = self._addresses.get(peer_id)
        elif entry is not None and age > ADDRESS_TTL_S:
            self._refresh_soon()  # keep using the cached address meanwhile
        if entry is None:
            return None
        skipped = self._unreachable.get(peer_id)
        if skipped is not None and skipped[0] == entry[0] and skipped[1] > now:
            return None
        return entry[0]

    def _refresh_soon(self) -> asyncio.Task:
        if self._lookup is None or self._lookup.done():
            self._lookup = asyncio.ensure_future(self._read_table())
        return self._lookup

    async def _refresh(self) -> None:
        await asyncio.wait({self._refresh_soon()}, timeout=LOOKUP_TIMEOUT_S)  # never cancels the shared read

    async def _read_table(self) -> None:
        try:
            records = await asyncio.wait_for(self.discovery.get(self.key), LOOKUP_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError) as e:  # DiscoveryError or no answer: p2pd for now
            logger.info("could not read data plane addresses: %r", e)
            records = None
        finally:
            self._looked_up_at = time.monotonic()
        if records is None:
            return
        table = {}
        for owner, record in records.items():
            address = _valid_address(record.value)
            if address is not None:
                table[owner] = (address, record.expiration_time)
        self._addresses = table

    def _mark_unreachable(self, peer_id: str, address: tuple[str, int]) -> None:
        self._unreachable[peer_id] = (address, time.monotonic() + UNREACHABLE_RETRY_S)
        if len(self._unreachable) > _LOGGED_MAX:
            now = time.monotonic()
            self._unreachable = {p: v for p, v in self._unreachable.items() if v[1] > now}

    def _log_fallback(self, peer_id: str, reason: str) -> None:
        if peer_id in self._logged_fallback:
            return
        if len(self._logged_fallback) >= _LOGGED_MAX:
            self._logged_fallback.clear()
        self._logged_fallback.add(peer_id)
        logger.info("streams to %s go through p2pd: %s", peer_id, reason[:200],
                    extra={"event": "direct_fallback", "peer": peer_id, "reason": reason[:200]})

    def __getattr__(self, name: str) -> Any:  # p2p, report() etc. of the inner streams
        if name.startswith("__") or "_inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._inner, name)
