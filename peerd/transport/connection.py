"""One direct TCP connection of the data plane, read and written like an asyncio stream, upgraded to TLS 1.3.

:class:`Connection` drives its non-blocking socket with the event loop's readiness callbacks (``add_reader`` /
``add_writer``); a large ``readexactly`` receives straight into its result. :meth:`Connection.start_tls` wraps the
socket in an :class:`ssl.SSLSocket` after the plaintext hello of :mod:`peerd.transport.handshake`, so that OpenSSL
reads and writes the socket itself. That halves TLS's CPU per byte against ``loop.start_tls`` (uvloop's and
asyncio's TLS pass every byte through memory BIOs and a new ``bytes`` per chunk; measured in docs/benchmarks.md).
:class:`Listener` accepts such connections. Also the socket helpers of :mod:`peerd.transport.direct`: kernel
buffer tuning and address resolution.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
from collections import deque
from typing import Any, Callable, Optional

from protocols.wire import ProtocolViolation, StreamCorrupted

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
#: Connections accepted per wakeup of the listener at most (the rest on the next one).
_ACCEPTS_PER_WAKEUP = 64
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
    """Fixed kernel buffers if asked for and the system allows them; no Nagle delay on handshake frames."""
    rmem_max, wmem_max = buffer_caps()
    with contextlib.suppress(OSError):
        if buffer_bytes and rmem_max >= buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        if buffer_bytes and wmem_max >= buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def resolve(host: str, port: int) -> tuple[int, tuple]:
    """Address family and socket address of ``host:port``; IP literals skip getaddrinfo (a thread pool round trip
    of up to ~10 ms on a busy machine)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return infos[0][0], infos[0][4]
    return (socket.AF_INET, (host, port)) if ip.version == 4 else (socket.AF_INET6, (host, port, 0, 0))


class Connection:
    """One direct TCP connection, read and written like an asyncio stream (``readexactly``, ``read``, ``write``,
    ``drain``, ``close``), driven by the event loop's readiness callbacks on its non-blocking socket.

    After :meth:`start_tls` the socket is an :class:`ssl.SSLSocket`: OpenSSL reads and writes the socket itself,
    decrypting straight into the reader's buffer and encrypting straight from the writer's (no memory BIO, no
    intermediate ``bytes`` per record). A large ``readexactly`` receives straight into its result; a ``write``
    keeps a reference to its buffer (no copy) until it is handed to the kernel: do not modify the buffer until
    :meth:`drain` returned. Bytes beyond what a read asked for are buffered; reading pauses above
    STREAM_LIMIT_BYTES of them. A read that is cancelled keeps what it received buffered, like StreamReader.
    """

    def __init__(self, sock: socket.socket):
        self._loop = asyncio.get_running_loop()
        self._sock: socket.socket = sock
        self._fd = sock.fileno()
        try:
            self._peername = sock.getpeername()
        except OSError:
            self._peername = None
        self._buffer = bytearray()  # received, not yet read
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        self._target: Optional[memoryview] = None  # where a large read receives its bytes
        self._target_filled = 0
        self._waiter: Optional[asyncio.Future] = None
        self._reading = False  # our reader callback is registered
        self._eof = False
        self._error: Optional[BaseException] = None
        self._pending: deque = deque()  # memoryviews handed to write(), not yet to the kernel
        self._writing = False  # our writer callback is registered
        self._drain_waiter: Optional[asyncio.Future] = None
        self._closing = False
        self._closed = False
        self._tls = False

    # ----------------------------------------------------------------------------------------------- reading

    def _start_reading(self) -> None:
        if not self._reading and not self._closed and not self._eof:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)
            if self._tls and self._sock.pending():  # OpenSSL holds decrypted bytes: the socket will not wake us
                self._loop.call_soon(self._on_readable)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def _on_readable(self) -> None:
        if not self._reading:
            return
        while True:
            target = self._target
            if target is not None:
                view = target[self._target_filled:]
            elif len(self._buffer) >= STREAM_LIMIT_BYTES:
                self._stop_reading()  # resumed by the next read
                return
            else:
                view = self._scratch
            try:
                n = self._sock.recv_into(view)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except (OSError, ssl.SSLError) as e:  # a reset, or a record that failed TLS's authentication
                self._lose(e)
                return
            if n == 0:
                self._eof = True
                self._stop_reading()
                self._wake()
                return
            if target is not None:
                self._target_filled += n
                if self._target_filled == len(target):
                    self._target = None  # complete: later bytes go to the buffer
                    self._wake()
            else:
                self._buffer += view[:n]
                self._wake()
            if not self._tls and (self._waiter is None or self._waiter.done()):
                self._stop_reading()  # before TLS, read only on demand: the TLS handshake's bytes are OpenSSL's
                return

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        self._start_reading()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _incomplete(self, partial: bytes, n: int) -> BaseException:
        if self._error is not None:
            return self._lost_error()
        return asyncio.IncompleteReadError(partial, n)

    def _lost_error(self) -> ConnectionResetError:
        if isinstance(self._error, ssl.SSLError) and not isinstance(self._error, ssl.SSLEOFError):
            return StreamCorrupted(f"connection lost: {self._error!r}")  # e.g. a record failed its authentication
        return ConnectionResetError(f"connection lost: {self._error!r}")

    def _take(self, n: int) -> bytes:
        data = bytes(memoryview(self._buffer)[:n])
        del self._buffer[:n]
        if self._tls and len(self._buffer) < STREAM_LIMIT_BYTES:
            self._start_reading()
        return data

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
        return self._take(n)

    async def _read_into_result(self, n: int) -> bytearray:
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
                    raise self._lost_error()
                return b""
            await self._wait()
        return self._take(len(self._buffer) if n < 0 else min(n, len(self._buffer)))

    def at_eof(self) -> bool:
        return self._eof and not self._buffer

    # ----------------------------------------------------------------------------------------------- writing

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` (as much as the kernel takes now, the rest as the socket drains). Keeps a reference to
        ``data`` until it was sent. Raises ConnectionResetError if the connection is closed."""
        if self._closing or self._error is not None:
            raise ConnectionResetError(f"connection closed: {self._error!r}")
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return
        self._pending.append(view)
        if not self._writing:
            self._on_writable()

    def _on_writable(self) -> None:
        pending, send = self._pending, self._sock.send
        while pending:
            view = pending[0]
            try:
                n = send(view)  # TLS: as many whole records as the socket takes (partial writes are enabled)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                # a TLS write must be retried with the same buffer: the head stays as it is
                if not self._writing:
                    self._writing = True
                    self._loop.add_writer(self._fd, self._on_writable)
                return
            except (OSError, ssl.SSLError) as e:
                self._lose(e)
                return
            if n == view.nbytes:
                pending.popleft()
            else:
                pending[0] = view[n:]
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)
        if self._closing and not self._closed:
            self._finish_close()

    @property
    def writing_paused(self) -> bool:
        """Written bytes are waiting for the socket: :meth:`drain` would wait."""
        return bool(self._pending)

    async def drain(self) -> None:
        """Wait until everything written was handed to the kernel. Raises ConnectionResetError if the connection
        broke."""
        if self._error is not None:
            raise self._lost_error()
        if not self._pending:
            return
        if self._drain_waiter is None or self._drain_waiter.done():
            self._drain_waiter = self._loop.create_future()
        await asyncio.shield(self._drain_waiter)
        if self._error is not None:
            raise self._lost_error()

    # ------------------------------------------------------------------------------------------------ closing

    def _lose(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._eof = True
        self._pending.clear()
        self._wake()
        self._finish_close()

    def _finish_close(self) -> None:
        if self._closed:
            return
        self._closed = self._closing = True
        self._stop_reading()
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        if self._tls and self._error is None:
            with contextlib.suppress(OSError, ValueError):  # best effort: the TLS close_notify, then no waiting
                self._sock.unwrap()
        self._sock.close()
        self._eof = True
        self._wake()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    def close(self) -> None:
        """Close after what was written has been sent (no more writes)."""
        self._closing = True
        if not self._pending:
            self._finish_close()

    def abort(self) -> None:
        """Close at once, dropping what was not sent (TLS: without a close_notify, so the other side sees an error)."""
        if not self._closed:
            self._pending.clear()
            if self._error is None:
                self._error = ConnectionAbortedError("aborted")
            self._finish_close()

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self._peername
        if name == "socket":
            return self._sock
        if name == "ssl_object":
            return self._sock if self._tls else default
        return default

    # --------------------------------------------------------------------------------------------------- TLS

    async def start_tls(self, context: ssl.SSLContext, server_side: bool) -> None:
        """Run a TLS handshake over this connection (within TLS_HANDSHAKE_TIMEOUT_S); afterwards every byte read or
        written goes through TLS.

        Both sides must have read everything the other sent before (the hello exchange is strictly alternating):
        a byte received ahead of the handshake raises ProtocolViolation. Raises ssl.SSLError (and ConnectionError,
        OSError, asyncio.TimeoutError) if the handshake fails; the connection is then unusable.
        """
        if self._buffer or self._eof or self._pending:
            raise ProtocolViolation("bytes or EOF received ahead of the TLS handshake")
        if self._closing:
            raise ConnectionResetError("connection closed")
        self._stop_reading()
        sock = context.wrap_socket(self._sock, server_side=server_side, do_handshake_on_connect=False,
                                   suppress_ragged_eofs=False)
        self._sock, self._tls = sock, True
        await asyncio.wait_for(self._handshake(sock), TLS_HANDSHAKE_TIMEOUT_S)

    async def _handshake(self, sock: ssl.SSLSocket) -> None:
        while True:
            try:
                sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self._ready(self._loop.add_reader, self._loop.remove_reader)
            except ssl.SSLWantWriteError:
                await self._ready(self._loop.add_writer, self._loop.remove_writer)

    async def _ready(self, add: Any, remove: Any) -> None:
        ready = self._loop.create_future()
        add(self._fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            remove(self._fd)

    def peer_certificate(self) -> Optional[bytes]:
        """The certificate (DER) the other side proved it holds the key of in the TLS handshake, or None."""
        return self._sock.getpeercert(binary_form=True) if self._tls else None


class Listener:
    """A listening socket whose accepted connections become :class:`Connection` s handed to ``on_connect`` (which
    must not block). ``sockets``: the listening socket, as :class:`asyncio.Server` has it."""

    def __init__(self, sock: socket.socket, on_connect: Callable[[Connection], None]):
        self._loop = asyncio.get_running_loop()
        self._on_connect = on_connect
        self.sockets = [sock]
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        listener = self.sockets[0]
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors, or the peer reset it already: try on the next wakeup
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._on_connect(Connection(sock))

    def close(self) -> None:
        if self.sockets:
            sock = self.sockets.pop()
            self._loop.remove_reader(sock.fileno())
            sock.close()

    async def wait_closed(self) -> None:
        return None


async def listen(sock: socket.socket, on_connect: Callable[[Connection], None], backlog: int = 100) -> Listener:
    """Listen on the bound socket ``sock``; every accepted connection goes to ``on_connect(conn)``."""
    sock.listen(backlog)
    return Listener(sock, on_connect)


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
        return Connection(sock)
    except BaseException:
        sock.close()
        raise
