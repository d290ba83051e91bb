"""A direct TCP data plane for bulk peer streams, authenticated with the peers' identity keys; p2pd as fallback.

Every byte of a libp2p stream crosses two unix sockets and the TLS/yamux layers of two Go daemons (p2pd), which caps
one stream at a few hundred MB/s and costs CPU in both daemons. :class:`DirectStreams` wraps the transport's
:class:`protocols.interfaces.PeerStreams` and moves streams over plain TCP between the two Python processes instead:

- ``start()`` listens on ``host:port`` and publishes ``{"host", "port"}`` under :data:`DATAPLANE_KEY`, subkey = our
  PeerID, re-published every :data:`REPUBLISH_INTERVAL_S`. Through the daemon's
  :class:`peerd.transport.records.SignedDiscovery` the record is signed by its owner, so nobody can point another
  peer's address elsewhere. (A wrong address alone gets nobody a stream: the handshake below fails there and the
  stream falls back to p2pd.)
- ``add_handler`` serves a name on both the inner streams and the direct listener; ``open`` looks the peer's
  address up (one DHT read returns every peer's address; cached), connects and runs the handshake; if the peer has no
  address, cannot be reached or fails the handshake, it falls back to ``inner.open`` (logged once per peer).

**Handshake** (msgpack frames of :mod:`protocols.wire`, at most :data:`HANDSHAKE_TIMEOUT_S` in all)::

    client -> server  {v, from: client PeerID, to: server PeerID, name, nonce: 32 random bytes}
    server -> client  {v, from: server PeerID, nonce: 32 random bytes,
                       sig: sign_server(DOMAIN, "server", client nonce, client PeerID, name)}
    client -> server  {sig: sign_client(DOMAIN, "client", server nonce, server PeerID, name)}  then the stream's bytes

Each side proves it holds the Ed25519 key embedded in the PeerID the other meant to talk to, over a fresh nonce of
the other side (no replay), for this handler name; the role string keeps one side's signature from being reflected as
the other's. The server refuses a hello for another PeerID or a name it does not serve. The handler receives the
*authenticated* client PeerID, exactly as with p2pd streams.

**What this does not give.** The bytes after the handshake are neither encrypted nor integrity-protected: the
handshake authenticates the endpoints, not the channel, so an on-path attacker (who can relay the handshake and then
read or rewrite the TCP stream) sees and can alter the data. So can anyone who can change a peer's address record and
relay both handshakes to the real peer: use SignedDiscovery (the daemon does). That is acceptable for what travels
here (tensor parts, matchmaking messages, state downloads): none of it is secret, and the protocols already treat
every received byte as untrusted (sizes, finiteness and weights are checked; robust aggregation bounds what a liar can
do). An on-path attacker can still make an honest peer look like a liar (and get it excluded or banned); where that
matters, keep p2pd's streams. The DHT and everything else hivemind does stay on libp2p.

Layering in the daemon: HivemindTransport -> SignedDiscovery -> DirectStreams -> pacing -> admission; attributes this
class does not define are looked up on the inner streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections import Counter
from typing import Any, Optional

import msgpack
from cryptography.exceptions import InvalidSignature

from peerd.identity.namespace import network_key
from peerd.identity.signing import InvalidRecord, Signer, public_key_of
from peerd.transport.linger import serve_stream
from peerd.transport.mux import MUX_NAME, MuxSession, MuxStream
from protocols.interfaces import Discovery, PeerStreams, StreamHandler
from protocols.wire import ProtocolViolation, read_frame, require, try_write_frame, write_frame

logger = logging.getLogger(__name__)

#: DHT key of the data plane addresses; subkey = the owner's PeerID, value = ``{"host": str, "port": int}``.
DATAPLANE_KEY = network_key("dataplane")  # "peerd.dataplane": one key for the whole network, not per run
#: Handshake protocol version and signature domain (never valid as another protocol's signature).
VERSION = 1
DOMAIN = "peerd-direct/1"
NONCE_BYTES = 32

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
#: Read-ahead a direct connection buffers before it stops reading from its socket (bytes).
STREAM_LIMIT_BYTES = 1 << 20
#: Receive buffer for small reads and read-ahead, per connection (bytes).
_SCRATCH_BYTES = 256 * 1024
#: A read still missing at least this many bytes receives straight into its result (bytes).
_DIRECT_READ_BYTES = 64 * 1024
#: Fixed kernel socket buffers (bytes), or 0 for Linux's autotuning (the default). A fixed size turns autotuning off
#: and is capped by net.core.{r,w}mem_max (208 KB on a stock kernel), so it is applied only where those caps allow
#: it. Measured on loopback: 4 MiB fixed and autotuning move one stream equally fast (~1.7 GB/s); autotuning also
#: grows up to net.ipv4.tcp_rmem's maximum (6-32 MiB) on long fat WAN paths, where a fixed 4 MiB would cap it.
SOCKET_BUFFER_BYTES = 0
#: Longest handler name accepted in a hello (characters).
MAX_NAME_CHARS = 256
#: Distinct peers / remote hosts remembered for log-once messages.
_LOGGED_MAX = 4096
#: With ``multiplex``, the peer with the larger PeerID waits this long for the other's connection before dialling
#: one itself, so that two peers opening streams to each other at once end up with one connection, not two (s).
DIAL_GRACE_S = 0.2


class HandshakeFailed(ConnectionError):
    """The other side is not who it should be, or does not follow the handshake (the message says why)."""


class HandshakeRefused(HandshakeFailed):
    """The server answered the hello with a refusal; ``code`` says why (one of :data:`REFUSALS`)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


#: Why a server refuses a hello: another peer listens there (a stale address), the name is not served, or the hello
#: does not follow the protocol.
REFUSALS = ("wrong_peer", "not_served", "malformed")


# ------------------------------------------------------------------------------------------------------ handshake


def transcript(role: str, nonce: bytes, peer_id: str, name: str) -> bytes:
    """The bytes one side signs: ``role`` ("server" | "client") over the other side's ``nonce`` and PeerID."""
    return msgpack.packb([DOMAIN, role, nonce, peer_id, name], use_bin_type=True)


def _verify(peer_id: str, signature: bytes, message: bytes) -> None:
    try:
        public_key_of(peer_id).verify(signature, message)
    except (InvalidSignature, InvalidRecord):
        raise HandshakeFailed(f"signature does not verify with the key of {peer_id}") from None


async def client_handshake(reader: Any, writer: Any, signer: Signer, server_peer_id: str, name: str,
                           claimed_peer_id: Optional[str] = None) -> None:
    """Authenticate ``server_peer_id`` and ourselves on a fresh connection; afterwards the stream is the handler's.

    ``claimed_peer_id`` (default: the signer's) exists for tests of impostors. Raises HandshakeRefused if the server
    refused the hello, HandshakeFailed if it did not prove ``server_peer_id``'s key, ProtocolViolation on malformed
    frames, ConnectionError/OSError if the connection broke.
    """
    me = claimed_peer_id or signer.peer_id
    nonce = os.urandom(NONCE_BYTES)
    await write_frame(writer, {"v": VERSION, "from": me, "to": server_peer_id, "name": name, "nonce": nonce})
    reply, _, _ = await read_frame(reader, max_payload_bytes=0)
    if "error" in reply:
        code = reply.get("code") if reply.get("code") in REFUSALS else "malformed"
        raise HandshakeRefused(f"{server_peer_id} refused {name!r}: {str(reply['error'])[:200]}", code)
    if require(reply, "v", int) != VERSION or require(reply, "from", str) != server_peer_id:
        raise HandshakeFailed(f"reached {str(reply.get('from'))[:60]}, not {server_peer_id}")
    server_nonce = require(reply, "nonce", bytes)
    if len(server_nonce) != NONCE_BYTES:
        raise ProtocolViolation(f"server nonce of {len(server_nonce)} bytes")
    _verify(server_peer_id, require(reply, "sig", bytes), transcript("server", nonce, me, name))
    await write_frame(writer, {"sig": signer.sign(transcript("client", server_nonce, server_peer_id, name))})


async def server_handshake(reader: Any, writer: Any, signer: Signer, served: Any) -> tuple[str, str]:
    """Serve one handshake; returns ``(client PeerID, handler name)`` once the client proved its key.

    ``served(name)`` says whether a name is served. Raises HandshakeFailed (after a best-effort refusal frame) or
    ProtocolViolation; the caller closes the connection.
    """
    hello, _, _ = await read_frame(reader, max_payload_bytes=0)
    version = require(hello, "v", int)
    client = require(hello, "from", str)
    to = require(hello, "to", str)
    name = require(hello, "name", str)
    nonce = require(hello, "nonce", bytes)
    code = reason = None
    if version != VERSION:
        code, reason = "malformed", f"version {version} is not {VERSION}"
    elif to != signer.peer_id:
        code, reason = "wrong_peer", f"this is not {to[:60]}"
    elif len(nonce) != NONCE_BYTES or len(name) > MAX_NAME_CHARS:
        code, reason = "malformed", "nonce or name of the wrong size"
    elif not served(name):
        code, reason = "not_served", f"{name[:80]!r} is not served"
    else:
        try:
            public_key_of(client)
        except InvalidRecord:
            code, reason = "malformed", "'from' is not an Ed25519 PeerID"
    if code is not None:
        await try_write_frame(writer, {"v": VERSION, "error": reason, "code": code}, timeout_s=1.0)
        raise HandshakeRefused(f"refused hello: {reason}", code)
    my_nonce = os.urandom(NONCE_BYTES)
    await write_frame(writer, {"v": VERSION, "from": signer.peer_id, "nonce": my_nonce,
                               "sig": signer.sign(transcript("server", nonce, client, name))})
    proof, _, _ = await read_frame(reader, max_payload_bytes=0)
    _verify(client, require(proof, "sig", bytes), transcript("client", my_nonce, signer.peer_id, name))
    return client, name


# -------------------------------------------------------------------------------------------------------- sockets


def _buffer_caps() -> tuple[int, int]:
    caps = []
    for name in ("rmem_max", "wmem_max"):
        try:
            with open(f"/proc/sys/net/core/{name}") as f:
                caps.append(int(f.read().split()[0]))
        except (OSError, ValueError, IndexError):
            caps.append(0)
    return caps[0], caps[1]


def _tune(sock: socket.socket, buffer_bytes: int) -> None:
    """Fixed kernel buffers if asked for and the system allows them; no Nagle delay on handshake frames."""
    rmem_max, wmem_max = _buffer_caps()
    with contextlib.suppress(OSError):
        if buffer_bytes and rmem_max >= buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        if buffer_bytes and wmem_max >= buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _resolve(host: str, port: int) -> tuple[int, tuple]:
    """Address family and socket address of ``host:port``; IP literals skip getaddrinfo (a thread pool round trip
    of up to ~10 ms on a busy machine)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return infos[0][0], infos[0][4]
    return (socket.AF_INET, (host, port)) if ip.version == 4 else (socket.AF_INET6, (host, port, 0, 0))


def _valid_address(value: Any) -> Optional[tuple[str, int]]:
    if not isinstance(value, dict):
        return None
    host, port = value.get("host"), value.get("port")
    if not isinstance(host, str) or not 0 < len(host) <= 255 or host in ("0.0.0.0", "::"):
        return None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    return host, port


class _Connection(asyncio.BufferedProtocol):
    """One direct TCP connection, read and written like an asyncio stream (``readexactly``, ``write``, ``drain``,
    ``close``), but a large ``readexactly`` receives straight into its result: one copy out of the kernel and one
    into the returned ``bytes``. (:class:`asyncio.StreamReader` grows a bytearray chunk by chunk, which costs ~10x the
    CPU per byte on a 25 MB read and made a direct stream slower than p2pd's.)

    Bytes beyond what a read asked for are buffered; reading pauses above STREAM_LIMIT_BYTES of them. A read that is
    cancelled keeps what it received buffered, like StreamReader.
    """

    def __init__(self, on_connect: Optional[Any] = None):
        self._on_connect = on_connect
        self._transport: Optional[asyncio.Transport] = None
        self._buffer = bytearray()  # received, not yet read
        self._scratch = bytearray(_SCRATCH_BYTES)
        self._target: Optional[memoryview] = None  # where a large read receives its bytes
        self._target_filled = 0
        self._waiter: Optional[asyncio.Future] = None
        self._drain_waiter: Optional[asyncio.Future] = None
        self._eof = False
        self._lost = False
        self._error: Optional[BaseException] = None
        self._reading_paused = False
        self._writing_paused = False

    # protocol callbacks (the event loop calls these)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if self._on_connect is not None:
            self._on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._target_filled:]
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._target_filled += nbytes
            if self._target_filled == len(self._target):
                self._target = None  # complete: later bytes go to the buffer
                self._wake()
            return
        self._buffer += memoryview(self._scratch)[:nbytes]
        if len(self._buffer) > STREAM_LIMIT_BYTES and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return True  # keep our side open for writing, as StreamReaderProtocol does

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._lost, self._eof, self._error = True, True, exc
        self._wake()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    def pause_writing(self) -> None:
        self._writing_paused = True

    @property
    def writing_paused(self) -> bool:
        """The transport's write buffer is above its high-water mark: :meth:`drain` would wait."""
        return self._writing_paused

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # reading

    async def _wait(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _incomplete(self, partial: bytes, n: int) -> BaseException:
        if self._error is not None:
            return ConnectionResetError(f"connection lost: {self._error!r}")
        return asyncio.IncompleteReadError(partial, n)

    async def readexactly(self, n: int) -> bytes | bytearray:
        """Exactly ``n`` bytes (a bytearray for a large read). Raises IncompleteReadError at EOF,
        ConnectionResetError if the connection broke."""
        if n < 0:
            raise ValueError("readexactly size can not be less than zero")
        if self._waiter is not None:
            raise RuntimeError("readexactly() called while another read is waiting")
        if len(self._buffer) < n and n - len(self._buffer) >= _DIRECT_READ_BYTES and not self._eof:
            return await self._read_into_result(n)
        while len(self._buffer) < n:
            if self._eof:
                partial = bytes(self._buffer)
                self._buffer.clear()
                raise self._incomplete(partial, n)
            await self._wait()
        data = bytes(memoryview(self._buffer)[:n])
        del self._buffer[:n]
        if self._reading_paused and len(self._buffer) <= STREAM_LIMIT_BYTES:
            self._reading_paused = False
            self._transport.resume_reading()
        return data

    async def _read_into_result(self, n: int) -> bytes:
        result = bytearray(n)
        have = len(self._buffer)
        result[:have] = self._buffer
        self._buffer.clear()
        self._target, self._target_filled = memoryview(result), have
        try:
            while self._target is not None:
                if self._eof:
                    partial, self._target = bytes(memoryview(result)[:self._target_filled]), None
                    raise self._incomplete(partial, n)
                await self._wait()
        except BaseException:
            if self._target is not None:  # unfinished (cancelled, EOF): keep what arrived, as StreamReader does
                self._buffer[:0] = memoryview(result)[:self._target_filled]
                self._target = None
            raise
        return result  # a bytearray: copying it into bytes would cost a pass over every byte of a large read

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` buffered bytes (all if ``n < 0``), waiting for at least one; b"" at EOF. Raises
        ConnectionResetError if the connection broke."""
        if self._waiter is not None:
            raise RuntimeError("read() called while another read is waiting")
        while not self._buffer:
            if self._eof:
                if self._error is not None:
                    raise ConnectionResetError(f"connection lost: {self._error!r}")
                return b""
            await self._wait()
        take = len(self._buffer) if n < 0 else min(n, len(self._buffer))
        data = bytes(memoryview(self._buffer)[:take])
        del self._buffer[:take]
        if self._reading_paused and len(self._buffer) <= STREAM_LIMIT_BYTES:
            self._reading_paused = False
            self._transport.resume_reading()
        return data

    def at_eof(self) -> bool:
        return self._eof and not self._buffer

    # writing

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._lost or self._transport.is_closing():  # uvloop would raise RuntimeError; callers expect this
            raise ConnectionResetError(f"connection closed: {self._error!r}")
        self._transport.write(data)

    async def drain(self) -> None:
        if self._lost:
            raise ConnectionResetError(f"connection lost: {self._error!r}")
        if not self._writing_paused:
            return
        self._drain_waiter = asyncio.get_running_loop().create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None
        if self._lost:
            raise ConnectionResetError(f"connection lost: {self._error!r}")

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default) if self._transport is not None else default


# -------------------------------------------------------------------------------------------------- DirectStreams


class DirectStreams:
    """:class:`protocols.interfaces.PeerStreams` over authenticated direct TCP, falling back to ``inner``.

    ``host``/``port``: where to listen (port 0 = any free port); ``announce_host``: the host others should dial
    (default ``host``; required if ``host`` is a wildcard). ``signer`` must hold the key of ``inner.peer_id``.
    ``key``: the DHT key of the address table; ``socket_buffer_bytes``: see :data:`SOCKET_BUFFER_BYTES`.
    ``multiplex``: carry every stream to a peer over one long-lived connection (:mod:`peerd.transport.mux`), dialled
    once and reused across rounds (re-dialled if it drops), instead of one connection per stream.
    Before :meth:`start` and after :meth:`stop`, every stream goes through ``inner``. ``stats`` counts direct and
    fallback opens, direct streams served, refused handshakes, and TCP connections dialled (``tcp_dials``).
    """

    def __init__(self, inner: PeerStreams, discovery: Discovery, signer: Signer, host: str, port: int = 0,
                 announce_host: Optional[str] = None, *, key: str = DATAPLANE_KEY,
                 socket_buffer_bytes: int = SOCKET_BUFFER_BYTES, multiplex: bool = False):
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
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _tune(sock, self.socket_buffer_bytes)  # accepted sockets inherit the listener's buffers
            sock.bind(sockaddr)
            sock.setblocking(False)
            self._server = await loop.create_server(lambda: _Connection(self._accepted), sock=sock,
                                                    backlog=MAX_PENDING_HANDSHAKES)
        except BaseException:
            sock.close()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
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

    async def _publish(self) -> bool:
        expiration = self.discovery.time() + RECORD_TTL_S
        try:
            ok = await asyncio.wait_for(
                self.discovery.store(self.key, self.peer_id, {"host": self.announce_host, "port": self.port},
                                     expiration), LOOKUP_TIMEOUT_S)
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

    def _accepted(self, conn: _Connection) -> None:
        if self._server is None:
            conn.abort()
            return
        task = asyncio.ensure_future(self._serve(conn))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: _Connection) -> None:
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
                    server_handshake(reader, writer, self.signer, self._serves), HANDSHAKE_TIMEOUT_S)
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

    def _adopt(self, conn: _Connection, peer: str, dialer: bool) -> MuxSession:
        """Serve and use the multiplexed connection ``conn`` to ``peer``: our streams to it go there unless one is
        already in use."""
        session = MuxSession(conn, peer, dialer, self._handlers.__contains__,
                             lambda name, stream: self._serve_mux_stream(peer, name, stream))
        self._mux_all.add(session)
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
        """A direct stream to ``peer_id``'s ``name`` if possible, else ``inner.open`` (ConnectionError if neither)."""
        reason = "direct data plane stopped"
        if self._server is not None:
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
        loop = asyncio.get_running_loop()
        family, sockaddr = await _resolve(*address)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            _tune(sock, self.socket_buffer_bytes)
            sock.setblocking(False)
            self.stats["tcp_dials"] += 1
            await loop.sock_connect(sock, sockaddr)
            _, conn = await loop.create_connection(_Connection, sock=sock)
        except BaseException:
            sock.close()
            raise
        try:
            await client_handshake(conn, conn, self.signer, peer_id, name)
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
