"""One direct TCP connection of the data plane, read and written like an asyncio stream, upgraded to TLS 1.3.

:class:`Connection` is an :class:`asyncio.BufferedProtocol` whose ``readexactly`` receives a large read straight
into its result; :meth:`Connection.start_tls` puts TLS (``loop.start_tls``: uvloop's or asyncio's TLS, OpenSSL
underneath) between it and the socket after the plaintext hello of :mod:`peerd.transport.handshake`. Also the socket
helpers of :mod:`peerd.transport.direct`: kernel buffer tuning and address resolution.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import ssl
import struct
import sys
from typing import Any, NamedTuple, Optional

from protocols.wire import ProtocolViolation, StreamCorrupted

#: Read-ahead a direct connection buffers before it stops reading from its socket (bytes).
STREAM_LIMIT_BYTES = 1 << 20
#: A connection's read-ahead (:class:`ReadAhead`) at first, for small reads and bytes ahead of a read (bytes); grown
#: while more is unread.
_READ_AHEAD_BYTES = 256 * 1024
#: A receive is offered at least this much space (bytes), else the read-ahead is compacted or grown.
_MIN_SPACE_BYTES = 64 * 1024
#: A read still missing at least this many bytes receives straight into its result (bytes).
_DIRECT_READ_BYTES = 64 * 1024
#: While a large read waits, the kernel wakes the reader only once this many of its missing bytes are queued on the
#: socket (``SO_RCVLOWAT``), or the missing bytes less :data:`_LOWAT_SLACK_BYTES` where fewer are missing; 0: never
#: set. On a shaped link bytes arrive a few packets at a time, and every wakeup costs the event loop and TLS a pass
#: (~6 KB a wakeup at 100 Mbit/s): measured in ``scripts/bench_allreduce.py`` (4-peer ring, 100 Mbit/s), 18,500 ->
#: 10,000 wakeups that read (one peer, 3 runs) and 3.8 -> 3.0 CPU seconds an all-reduce (docs/benchmarks.md). Linux
#: only (elsewhere the option means something else, or nothing); ``PEERD_RCVLOWAT=0`` in the environment turns it off.
RCVLOWAT_MAX_BYTES = (256 * 1024) if sys.platform.startswith("linux") and os.environ.get("PEERD_RCVLOWAT") != "0" \
    else 0
#: What may sit undelivered in the TLS layer (bytes: one partial record, at most 2^14 = 16,384 bytes of plaintext,
#: RFC 8446 sec. 5.1), so never asked of the socket: a wakeup threshold above what is left to arrive would leave the
#: reader waiting for ever.
_LOWAT_SLACK_BYTES = 17 * 1024
#: Fixed kernel socket buffers (bytes), or 0 for Linux's autotuning (the default). A fixed size turns autotuning off
#: and is capped by net.core.{r,w}mem_max (208 KB on a stock kernel), so it is applied only where those caps allow
#: it. Measured on loopback: 4 MiB fixed and autotuning move one stream equally fast (~1.7 GB/s); autotuning also
#: grows up to net.ipv4.tcp_rmem's maximum (6-32 MiB) on long fat WAN paths, where a fixed 4 MiB would cap it.
SOCKET_BUFFER_BYTES = 0
#: Unsent bytes a direct connection's socket may hold (``TCP_NOTSENT_LOWAT``): a write that would queue more waits
#: until the kernel has put the queue on the wire, so what the data plane hands over has nearly left the host. Without
#: it, autotuning lets up to 4 MB a connection sit unsent, and an upload timed at hand-off (the butterfly's rate
#: measurement, :mod:`protocols.allreduce.parts`) read a 20 Mbit/s uplink as 8.7-43 MB/s; 0 (``PEERD_NOTSENT_LOWAT=0``
#: in the environment): never set.
NOTSENT_LOWAT_BYTES = 0 if os.environ.get("PEERD_NOTSENT_LOWAT") == "0" else 128 * 1024
#: TCP congestion control of the data plane's sockets (``TCP_CONGESTION``, e.g. ``cubic``, ``bbr``), from
#: ``PEERD_TCP_CONGESTION`` in the environment; empty (the default): the system's
#: (``/proc/sys/net/ipv4/tcp_congestion_control``). One the system does not offer is left out.
TCP_CONGESTION_NAME = os.environ.get("PEERD_TCP_CONGESTION", "")
#: Longest TLS handshake (seconds); the callers bound the whole handshake more tightly.
TLS_HANDSHAKE_TIMEOUT_S = 10.0


def buffer_caps() -> tuple[int, int]:
    caps = []
    for name in ("rmem_max", "wmem_max"):
        try:
            with open(f"/proc/sys/net/core/{name}") as f:
                caps.append(int(f.read().split()[0]))
        except (OSError, ValueError, IndexError):
            caps.append(0)
    return caps[0], caps[1]


def tune(sock: socket.socket, buffer_bytes: int) -> None:
    """Fixed kernel buffers if asked for and the system allows them; at most :data:`NOTSENT_LOWAT_BYTES` unsent; no
    Nagle delay on handshake frames; the congestion control :data:`TCP_CONGESTION_NAME` where one is named
    (:func:`set_congestion`). A listener's settings pass to the sockets it accepts."""
    rmem_max, wmem_max = buffer_caps()
    with contextlib.suppress(OSError):
        if buffer_bytes and rmem_max >= buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        if buffer_bytes and wmem_max >= buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if NOTSENT_LOWAT_BYTES and hasattr(socket, "TCP_NOTSENT_LOWAT"):  # Linux, macOS
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, NOTSENT_LOWAT_BYTES)
    set_congestion(sock, TCP_CONGESTION_NAME)


def set_congestion(sock: Any, name: str) -> bool:
    """Use TCP congestion control ``name`` (e.g. ``cubic``) on ``sock``; False, changing nothing, where ``name`` is
    empty or the system refuses it (not Linux, not available, or not allowed to this process)."""
    if not name or not hasattr(socket, "TCP_CONGESTION"):
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError:
        return False
    return True


#: ``SO_MAX_PACING_RATE`` (Linux; Python's socket module does not name it): the most bytes per second the kernel
#: sends on a socket, packet by packet (TCP paces itself to it, with or without the fq qdisc).
SO_MAX_PACING_RATE = 47
#: The rate that lifts a pace (bytes/s): the kernel's "unlimited" as Python's setsockopt passes it (a C int).
UNPACED_BYTES_PER_S = 2**31 - 1


def set_pacing(sock: Any, bytes_per_s: Optional[float]) -> bool:
    """Pace ``sock``'s sending at ``bytes_per_s`` (> 0; None: unpaced). Returns False where the system does not
    pace (not Linux, or the socket refuses), True otherwise.

    What it is for: the butterfly's connections share a sender's uplink, and unpaced they take turns overfilling the
    bottleneck's queue; each paced at its share of the link, plain TCP moving the butterfly's bytes went from
    0.77-0.89 to 0.91-0.95 of a 100 Mbit/s link (``scripts/bench_allreduce.py --impls tcp-paced``). A rate above the
    link's keeps almost none of that."""
    if not sys.platform.startswith("linux"):
        return False
    rate = UNPACED_BYTES_PER_S if bytes_per_s is None else max(1, min(int(bytes_per_s), UNPACED_BYTES_PER_S))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, rate)
    except OSError:
        return False
    return True


class SendCounters(NamedTuple):
    """What the kernel counted of one connection's sending (:func:`send_counters`), since it opened."""

    segments_delivered: int
    """Segments that reached the peer (``tcpi_delivered``): counted as the peer acknowledges or selectively
    acknowledges them, so their rate is the rate the path's bottleneck carried, without the jump of the cumulative
    acknowledgement (``tcpi_bytes_acked``) when a loss is repaired: that read 13.2-13.9 MB/s over 0.5 s on a link
    that carries 12.5."""
    segment_bytes: int
    """The connection's segment size now (``tcpi_snd_mss``, bytes): a bulk sender's segments are full."""
    path_limited_s: float
    """Seconds the connection had bytes to send and was held back by neither the receiver's window nor its own send
    buffer: by the path (its congestion window) or its pace. Near the wall time while the path is the bottleneck;
    far below it while the sender itself is (its bytes leave as fast as it writes them)."""


#: ``struct tcp_info`` (Linux >= 4.18): ``tcpi_snd_mss`` (u32) at byte 16; ``tcpi_busy_time``,
#: ``tcpi_rwnd_limited``, ``tcpi_sndbuf_limited`` (u64 microseconds; busy counts the other two too) at byte 168;
#: ``tcpi_delivered`` (u32) at byte 192.
_TCPI_SND_MSS = struct.Struct("=I"), 16
_TCPI_CHRONO = struct.Struct("=QQQ"), 168
_TCPI_DELIVERED = struct.Struct("=I"), 192


def send_counters(sock: Any) -> Optional[SendCounters]:
    """``sock``'s :class:`SendCounters` (Linux's ``TCP_INFO``); None where the system does not say (not Linux, a
    kernel older than 4.18, a closed socket)."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    (mss_layout, mss_at), (chrono_layout, chrono_at), (delivered_layout, delivered_at) = (
        _TCPI_SND_MSS, _TCPI_CHRONO, _TCPI_DELIVERED)
    if len(info) < delivered_at + delivered_layout.size:
        return None
    busy_us, rwnd_us, sndbuf_us = chrono_layout.unpack_from(info, chrono_at)
    return SendCounters(delivered_layout.unpack_from(info, delivered_at)[0], mss_layout.unpack_from(info, mss_at)[0],
                        (busy_us - rwnd_us - sndbuf_us) / 1e6)


async def resolve(host: str, port: int) -> tuple[int, tuple]:
    """Address family and socket address of ``host:port``; IP literals skip getaddrinfo (a thread pool round trip
    of up to ~10 ms on a busy machine)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return infos[0][0], infos[0][4]
    return (socket.AF_INET, (host, port)) if ip.version == 4 else (socket.AF_INET6, (host, port, 0, 0))


class ReadAhead:
    """Bytes received ahead of the reads that take them: ``data[start:end]`` of one bytearray that the transport
    receives into (:meth:`space`, :meth:`commit`), so that buffering them costs no copy of its own (appending each
    receive to a second bytearray cost a pass over the bytes: 6% of a peer's CPU in a loopback all-reduce, ~half of
    its bytes arriving ahead of their frame's read). Taken bytes leave from the front. When less than
    :data:`_MIN_SPACE_BYTES` of space is left, the unread bytes move to the front if they fit before their old place
    (``bytearray`` copies a slice with ``memcpy``, so the two must not overlap), else to a larger array.
    """

    def __init__(self, capacity: int = _READ_AHEAD_BYTES):
        self.data = bytearray(capacity)
        self.start = 0
        self.end = 0

    def __len__(self) -> int:
        return self.end - self.start

    def space(self) -> memoryview:
        """Where the next bytes may be received (at least :data:`_MIN_SPACE_BYTES`); :meth:`commit` what arrived."""
        unread = self.end - self.start
        if len(self.data) - self.end < _MIN_SPACE_BYTES:
            if unread <= self.start:  # compact: move the unread to the front (the two ranges do not overlap)
                self.data[:unread] = memoryview(self.data)[self.start:self.end]
            else:  # a new array, not a resize: the transport may still hold a view of this one
                grown = bytearray(max(2 * len(self.data), unread + _READ_AHEAD_BYTES))
                grown[:unread] = memoryview(self.data)[self.start:self.end]
                self.data = grown
            self.start, self.end = 0, unread
        return memoryview(self.data)[self.end:]

    def commit(self, nbytes: int) -> None:
        self.end += nbytes

    def take(self, n: int) -> bytes:
        """The first ``n`` unread bytes (at most all of them), as bytes."""
        n = min(n, self.end - self.start)
        out = bytes(memoryview(self.data)[self.start:self.start + n])
        self.start += n
        if self.start == self.end:
            self.start = self.end = 0
        return out

    def take_into(self, target: bytearray) -> int:
        """Move every unread byte to the front of ``target`` (at least as long); returns how many."""
        n = self.end - self.start
        target[:n] = memoryview(self.data)[self.start:self.end]
        self.start = self.end = 0
        return n

    def put_back(self, received: memoryview) -> None:
        """Put ``received`` in front of the unread bytes (a cancelled large read's bytes)."""
        unread = memoryview(self.data)[self.start:self.end]
        merged = bytearray(max(_READ_AHEAD_BYTES, len(received) + len(unread) + _MIN_SPACE_BYTES))
        merged[:len(received)] = received
        merged[len(received):len(received) + len(unread)] = unread
        self.data, self.start, self.end = merged, 0, len(received) + len(unread)


class Connection(asyncio.BufferedProtocol):
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
        self._buffer = ReadAhead()  # received, not yet read
        self._target: Optional[memoryview] = None  # where a large read receives its bytes
        self._target_filled = 0
        self._waiter: Optional[asyncio.Future] = None
        self._drain_waiter: Optional[asyncio.Future] = None
        self._eof = False
        self._lost = False
        self._error: Optional[BaseException] = None
        self._reading_paused = False
        self._writing_paused = False
        self._tls = False
        self._socket: Any = None  # the TCP socket while SO_RCVLOWAT may be set on it, else None
        self._lowat = 1  # the socket's SO_RCVLOWAT

    # protocol callbacks (the event loop calls these)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._socket = transport.get_extra_info("socket") if RCVLOWAT_MAX_BYTES else None
        if self._on_connect is not None:
            self._on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._target_filled:]
        return self._buffer.space()

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._target_filled += nbytes
            if self._target_filled == len(self._target):
                self._target = None  # complete: later bytes go to the buffer
                self._set_lowat(1)
                self._wake()
            else:
                self._set_lowat(len(self._target) - self._target_filled - _LOWAT_SLACK_BYTES)
            return
        self._buffer.commit(nbytes)
        if len(self._buffer) > STREAM_LIMIT_BYTES and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return not self._tls  # keep our side open for writing, as StreamReaderProtocol does (TLS cannot)

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

    def _set_lowat(self, missing: int) -> None:
        """Wake the reader once ``missing`` bytes (at least 1, at most :data:`RCVLOWAT_MAX_BYTES`) are queued on the
        socket; a socket that refuses is left alone from then on."""
        nbytes = max(1, min(missing, RCVLOWAT_MAX_BYTES))
        if nbytes != self._lowat and self._socket is not None:
            try:
                self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            except OSError:  # closed, or not a TCP socket
                self._socket = None
                return
            self._lowat = nbytes

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
            return self._lost_error()
        return asyncio.IncompleteReadError(partial, n)

    def _lost_error(self) -> ConnectionResetError:
        """The error a read or drain raises once the connection broke: StreamCorrupted if TLS found a record
        altered (its authentication failed), else ConnectionResetError."""
        if isinstance(self._error, ssl.SSLError) and not isinstance(self._error, ssl.SSLEOFError):
            return StreamCorrupted(f"connection lost: {self._error!r}")
        return ConnectionResetError(f"connection lost: {self._error!r}")

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
                raise self._incomplete(self._buffer.take(len(self._buffer)), n)
            await self._wait()
        data = self._buffer.take(n)
        if self._reading_paused and len(self._buffer) <= STREAM_LIMIT_BYTES:
            self._reading_paused = False
            self._transport.resume_reading()
        return data

    async def _read_into_result(self, n: int) -> bytes:
        result = bytearray(n)
        have = self._buffer.take_into(result)
        self._target, self._target_filled = memoryview(result), have
        self._set_lowat(n - have - _LOWAT_SLACK_BYTES)
        try:
            while self._target is not None:
                if self._eof:
                    partial, self._target = bytes(memoryview(result)[:self._target_filled]), None
                    raise self._incomplete(partial, n)
                await self._wait()
        except BaseException:
            if self._target is not None:  # unfinished (cancelled, EOF): keep what arrived, as StreamReader does
                self._buffer.put_back(memoryview(result)[:self._target_filled])
                self._target = None
                self._set_lowat(1)
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
                    raise self._lost_error()
                return b""
            await self._wait()
        data = self._buffer.take(len(self._buffer) if n < 0 else n)
        if self._reading_paused and len(self._buffer) <= STREAM_LIMIT_BYTES:
            self._reading_paused = False
            self._transport.resume_reading()
        return data

    def at_eof(self) -> bool:
        return self._eof and not self._buffer

    # writing

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue ``data``. Raises what a read raises once the connection is lost (StreamCorrupted where TLS found a
        record altered, so that a write noticing it first does not turn an attack on the path into a peer's fault);
        while the transport is closing and not yet lost, the data is dropped: the loss, with its cause, follows."""
        if self._lost:
            raise self._lost_error()
        if self._transport.is_closing():  # uvloop would raise RuntimeError; the reads and drains fail soon
            return
        self._transport.write(data)

    async def drain(self) -> None:
        if self._lost:
            raise self._lost_error()
        if not self._writing_paused:
            return
        self._drain_waiter = asyncio.get_running_loop().create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None
        if self._lost:
            raise self._lost_error()

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

    # TLS

    async def start_tls(self, context: ssl.SSLContext, server_side: bool) -> None:
        """Run a TLS handshake over this connection; afterwards every byte read or written goes through TLS.

        Both sides must have read everything the other sent before (the hello exchange is strictly alternating):
        a byte received ahead of the handshake raises ProtocolViolation. Raises ssl.SSLError (and ConnectionError,
        OSError, asyncio.TimeoutError) if the handshake fails; the connection is then unusable.
        """
        if self._buffer or self._eof:
            raise ProtocolViolation("bytes or EOF received ahead of the TLS handshake")
        if self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()
        loop = asyncio.get_running_loop()
        self._tls = True
        self._transport = await loop.start_tls(self._transport, self, context, server_side=server_side,
                                               ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S)

    def peer_certificate(self) -> Optional[bytes]:
        """The certificate (DER) the other side proved it holds the key of in the TLS handshake, or None."""
        ssl_object = self.get_extra_info("ssl_object") if self._tls else None
        return ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None


async def open_connection(host: str, port: int, buffer_bytes: int = SOCKET_BUFFER_BYTES) -> Connection:
    """A plain TCP :class:`Connection` to ``host:port`` (TCP_NODELAY, ``buffer_bytes`` as :func:`tune`). Raises
    OSError/ConnectionError if it cannot connect."""
    loop = asyncio.get_running_loop()
    family, sockaddr = await resolve(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        tune(sock, buffer_bytes)
        sock.setblocking(False)
        await loop.sock_connect(sock, sockaddr)
        _, conn = await loop.create_connection(Connection, sock=sock)
    except BaseException:
        sock.close()
        raise
    return conn
