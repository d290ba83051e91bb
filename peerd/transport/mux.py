"""Many streams over one long-lived, authenticated TCP connection per peer pair (the direct data plane's warm path).

A fresh TCP connection per stream and round pays a connect, a handshake and TCP slow start every time; on a shaped
WAN link that made the direct data plane slower than p2pd. :class:`MuxSession` carries any number of streams over one
connection that :mod:`peerd.transport.direct` authenticated once (handshake name :data:`MUX_NAME`), reused across
rounds; a dropped connection is simply dialled again by the next ``open``.

Frames (all integers big-endian)::

    u32 stream_id | u8 kind | u32 length | payload (length bytes, at most MAX_FRAME_BYTES)

Kinds: ``OPEN`` (payload: the handler name, UTF-8), ``DATA``, ``FIN`` (the sender writes no more on this stream),
``RESET`` (the stream is aborted, or the name is not served), ``WINDOW`` (payload: u32 bytes of credit). The dialer
numbers its streams odd, the acceptor even. Flow control is per stream: a sender may have at most
:data:`WINDOW_BYTES` unacknowledged bytes in flight; the receiver grants credit as the application reads, so one
stream's slow reader holds up only that stream, and a stream never buffers more than its window. A peer that breaks
the framing (oversized frame, data beyond its window, a stream number of the wrong parity) loses the connection.

A :class:`MuxStream` is both the reader and the writer of a stream, like the direct connection it replaces:
``readexactly``, ``read``, ``write``, ``drain``, ``close``. ``write`` keeps a reference to the buffer (no copy):
do not modify it until ``drain`` returned.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from typing import Any, Callable, Optional

from protocols.wire import StreamCorrupted

logger = logging.getLogger(__name__)

#: The handshake name of a multiplexed connection (never a handler name: those are ``<service>.<method>``). Version 2
#: raised MAX_FRAME_BYTES from 256 KiB to 1 MiB; a version-1 peer answers "not served" and the stream falls back to
#: the inner streams (p2pd) instead of breaking on a frame larger than it accepts.
MUX_NAME = "/peerd/mux/2"
_HEAD = struct.Struct(">IBI")
OPEN, DATA, FIN, RESET, WINDOW = range(5)
#: Per-stream credit (bytes): above a 100 Mbit/s x 300 ms bandwidth-delay product.
WINDOW_BYTES = 8 << 20
#: Largest payload of one frame (bytes): keeps streams interleaved fairly, and holds a whole all-reduce chunk
#: (131,072 fp32 values, 512 KiB) plus its frame prefix, so that its reader takes it without joining pieces.
MAX_FRAME_BYTES = 1 << 20
#: Writes shorter than this (frame prefixes, headers, small messages) are coalesced into one frame (bytes).
_SMALL_BYTES = 64 << 10
#: Streams one connection may carry at once; more OPENs are reset.
MAX_STREAMS = 1024
_MAX_NAME_BYTES = 256


class MuxStream:
    """One stream of a :class:`MuxSession`: reader and writer at once."""

    def __init__(self, session: "MuxSession", stream_id: int):
        self._session = session
        self.id = stream_id
        self._chunks: deque = deque()
        self._buffered = 0
        self._unacked = 0  # bytes read by the application, not yet granted back to the sender
        self._inflight = 0  # bytes received and not yet granted back (at most the window)
        self._eof = False
        self._error: Optional[BaseException] = None
        self._waiter: Optional[asyncio.Future] = None
        self._send_window = WINDOW_BYTES
        self._credit = asyncio.Event()
        self._pending: deque = deque()
        self._pending_bytes = 0
        self._flush_scheduled = False
        self._flushed = asyncio.Event()
        self._flushed.set()
        self._pump: Optional[asyncio.Task] = None
        self._closed = False  # close() called: no more writes, incoming data is dropped
        self._fin_sent = False

    # ------------------------------------------------------------------------------------------ session callbacks

    def _feed(self, data: bytes) -> None:
        if self._closed:  # nobody reads any more: hand the credit straight back
            self._session.send(WINDOW, self.id, struct.pack(">I", len(data)))
            return
        if self._inflight + len(data) > WINDOW_BYTES:
            raise ConnectionError(f"stream {self.id}: the peer sent beyond its window")
        self._chunks.append(data)
        self._buffered += len(data)
        self._inflight += len(data)
        self._wake()

    def _feed_eof(self) -> None:
        self._eof = True
        self._wake()
        self._session.forget_if_done(self)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._eof = True
        self._credit.set()
        self._wake()

    def _grant(self, credit: int) -> None:
        self._send_window += credit
        self._credit.set()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ----------------------------------------------------------------------------------------------------- reading

    async def _wait(self) -> None:
        if self._waiter is not None:
            raise RuntimeError("another read is waiting on this stream")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self, n: int) -> bytes:
        first = self._chunks[0] if self._chunks else b""
        if len(first) == n:
            data = self._chunks.popleft()
        elif len(first) > n:
            data, self._chunks[0] = first[:n], memoryview(first)[n:]
            data = bytes(data)
        else:
            parts, need = [], n
            while need:
                chunk = self._chunks[0]
                if len(chunk) <= need:
                    parts.append(self._chunks.popleft())
                    need -= len(chunk)
                else:
                    parts.append(chunk[:need])
                    self._chunks[0] = memoryview(chunk)[need:]
                    need = 0
            data = b"".join(parts)
        if isinstance(data, memoryview):  # a whole frame is returned as received (bytes or bytearray), no copy
            data = bytes(data)
        self._buffered -= n
        self._unacked += n
        if self._unacked >= WINDOW_BYTES // 2 and not self._session.closed:
            self._session.send(WINDOW, self.id, struct.pack(">I", self._unacked))
            self._inflight -= self._unacked
            self._unacked = 0
        return data

    def _reset(self) -> ConnectionResetError:
        kind = StreamCorrupted if isinstance(self._error, StreamCorrupted) else ConnectionResetError
        return kind(f"stream reset: {self._error}")

    def _ended(self, partial: bytes, n: int) -> BaseException:
        if self._error is not None:
            return self._reset()
        return asyncio.IncompleteReadError(partial, n)

    async def readexactly(self, n: int) -> bytes:
        """Exactly ``n`` bytes. Raises IncompleteReadError at the stream's end, ConnectionResetError if it broke."""
        if n < 0:
            raise ValueError("readexactly size can not be less than zero")
        if self._buffered >= n:
            return self._take(n)
        parts: list = []  # a read larger than the window must consume (and grant credit) as data arrives
        need = n
        try:
            while self._buffered < need:
                if self._buffered:
                    got = self._take(self._buffered)
                    parts.append(got)
                    need -= len(got)
                if self._eof:
                    raise self._ended(b"".join(parts), n)
                await self._wait()
            parts.append(self._take(need))
        except asyncio.CancelledError:  # keep what arrived for the next read, as StreamReader does
            for part in reversed(parts):
                self._chunks.appendleft(part)
                self._buffered += len(part)
            raise
        return parts[0] if len(parts) == 1 else b"".join(parts)  # a frame that arrived whole: as it arrived

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all buffered if ``n < 0``), waiting for one; b"" at the end. ConnectionResetError if
        the stream broke."""
        while not self._buffered:
            if self._eof:
                if self._error is not None:
                    raise self._reset()
                return b""
            await self._wait()
        return self._take(self._buffered if n < 0 else min(n, self._buffered))

    def at_eof(self) -> bool:
        return self._eof and not self._buffered

    # ----------------------------------------------------------------------------------------------------- writing

    def write(self, data: Any) -> None:
        if self._closed or self._error is not None:
            raise ConnectionResetError(f"stream {self.id} is closed: {self._error!r}")
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return
        self._pending.append(view)
        self._pending_bytes += view.nbytes
        self._flushed.clear()
        if self._pump is not None and not self._pump.done():
            return  # the pump waits for credit and sends in order
        if view.nbytes >= _SMALL_BYTES:
            self._flush()  # a frame's payload: send it with the small writes before it (its prefix, its header)
        elif not self._flush_scheduled:  # small writes wait for the rest of their frame, drain() or this callback
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send what the window allows, synchronously: consecutive small writes go out as one DATA frame, a large
        one starts its own frame(s), so the reader receives a whole RPC payload as one frame (no copy to join it).
        Whatever the window does not allow is left to the pump."""
        self._flush_scheduled = False
        if self._pump is not None and not self._pump.done():
            return
        try:
            while self._pending and self._send_window > 0 and self._error is None:
                self._send_frame()
        except (ConnectionError, OSError) as e:
            self._fail(e)
            self._pending.clear()
            self._pending_bytes = 0
        if self._pending and self._error is None:
            self._start_pump()
        elif not self._pending:
            self._flushed.set()

    def _send_frame(self) -> None:
        """One DATA frame of at most min(window, MAX_FRAME_BYTES) bytes from the head of the pending writes."""
        limit = min(self._send_window, MAX_FRAME_BYTES)
        parts, size = [], 0
        while self._pending and size < limit:
            view = self._pending[0]
            if parts and view.nbytes >= _SMALL_BYTES:
                break  # a large write starts its own frame
            n = min(view.nbytes, limit - size)
            parts.append(view[:n] if n < view.nbytes else view)
            size += n
            if n == view.nbytes:
                self._pending.popleft()
            else:
                self._pending[0] = view[n:]
        self._pending_bytes -= size
        self._send_window -= size
        self._session.send(DATA, self.id, parts)

    async def drain(self) -> None:
        """Wait until everything written was handed to the connection (and the connection drained)."""
        if self._pending and (self._pump is None or self._pump.done()):
            self._flush()
        if self._pending:
            await self._flushed.wait()
        if self._error is not None:
            raise self._reset()
        await self._session.drain()

    def close(self) -> None:
        """No more writes (the peer sees the end after what was written) and no more reads."""
        if self._closed:
            return
        self._closed = True
        self._chunks.clear()
        self._buffered = 0
        self._start_pump()

    def abort(self) -> None:
        if self._error is None and not self._session.closed:
            self._session.send(RESET, self.id)
        self._closed = True
        self._fail(ConnectionResetError("aborted"))
        self._session.forget(self)

    def is_closing(self) -> bool:
        return self._closed or self._error is not None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._session.conn.get_extra_info(name, default)

    def _start_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._run_pump())

    async def _run_pump(self) -> None:
        try:
            while self._pending or (self._closed and not self._fin_sent):
                if self._error is not None:
                    break
                if not self._pending:
                    self._session.send(FIN, self.id)
                    self._fin_sent = True
                    break
                while self._send_window <= 0 and self._error is None:
                    self._credit.clear()
                    await self._credit.wait()
                if self._error is not None:
                    break
                self._send_frame()
                await self._session.drain()
        except (ConnectionError, OSError) as e:
            self._fail(e)
        finally:
            if self._error is not None:
                self._pending.clear()
                self._pending_bytes = 0
            if not self._pending:
                self._flushed.set()
            self._session.forget_if_done(self)


class MuxSession:
    """The streams of one authenticated connection ``conn`` (reader and writer: ``readexactly``, ``write``,
    ``drain``, ``close``) to ``peer``. ``dialer``: we opened the connection (our streams are odd).
    ``on_stream(name, stream)`` serves an incoming stream (its return value is ignored; it must not block);
    ``served(name)`` says whether a name is served (else the OPEN is reset). ``closed_event`` is set when the
    connection ended."""

    def __init__(self, conn: Any, peer: str, dialer: bool, served: Callable[[str], bool],
                 on_stream: Callable[[str, MuxStream], None]):
        self.conn = conn
        self.peer = peer
        self.dialer = dialer
        self._served = served
        self._on_stream = on_stream
        self._next_id = 1 if dialer else 2
        self.streams: dict[int, MuxStream] = {}
        self.closed = False
        self.closed_event = asyncio.Event()
        self.opened = 0
        self._draining: Optional[asyncio.Future] = None
        self._reader = asyncio.ensure_future(self._read_loop())

    def open(self, name: str) -> MuxStream:
        """A new stream to ``name`` (no round trip: a name the peer does not serve resets it on first use). Raises
        ConnectionResetError if the connection is closed."""
        if self.closed:
            raise ConnectionResetError(f"the connection to {self.peer} is closed")
        stream = MuxStream(self, self._next_id)
        self._next_id += 2
        self.streams[stream.id] = stream
        self.opened += 1
        self.send(OPEN, stream.id, name.encode())
        return stream

    def send(self, kind: int, stream_id: int, payload: Any = b"") -> None:
        """Write one frame (header and payload back to back: frames of streams never interleave); ``payload`` is a
        bytes-like object or a list of them. A short frame is written as one buffer (one send, not several)."""
        if self.closed:
            raise ConnectionResetError(f"the connection to {self.peer} is closed")
        parts = payload if isinstance(payload, list) else [payload]
        length = sum(memoryview(p).nbytes for p in parts)
        head = _HEAD.pack(stream_id, kind, length)
        if length < _SMALL_BYTES:
            self.conn.write(b"".join([head, *parts]) if length else head)
            return
        self.conn.write(head)
        for part in parts:
            self.conn.write(part)

    async def drain(self) -> None:
        """Wait until the connection takes more bytes; every stream waits on the same drain (a connection may
        support only one waiter at a time). Returns at once, without a task, while the connection is not paused."""
        if self._draining is None or self._draining.done():
            if getattr(self.conn, "writing_paused", True) is False:
                await self.conn.drain()  # not paused: returns at once (or raises if the connection was lost)
                return
            self._draining = asyncio.ensure_future(self.conn.drain())
        await asyncio.shield(self._draining)

    def forget(self, stream: MuxStream) -> None:
        self.streams.pop(stream.id, None)

    def forget_if_done(self, stream: MuxStream) -> None:
        if (stream._fin_sent or stream._error is not None) and stream._eof:
            self.forget(stream)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.conn.close()  # a transport's close: never raises
        self._reader.cancel()

    async def _read_loop(self) -> None:
        error: BaseException = ConnectionResetError(f"the connection to {self.peer} closed")
        try:
            while True:
                stream_id, kind, length = _HEAD.unpack(await self.conn.readexactly(_HEAD.size))
                if length > MAX_FRAME_BYTES:
                    raise ConnectionError(f"frame of {length} bytes from {self.peer}")
                payload = await self.conn.readexactly(length) if length else b""
                self._dispatch(stream_id, kind, payload)
        except asyncio.CancelledError:
            pass
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
            error = e if isinstance(e, ConnectionError) else ConnectionResetError(repr(e))
            if not isinstance(e, asyncio.IncompleteReadError):
                logger.info("mux connection to %s ended: %r", self.peer, e)
        finally:
            self.closed = True
            self.conn.close()
            for stream in list(self.streams.values()):
                stream._fail(error)
            self.streams.clear()
            self.closed_event.set()

    def _dispatch(self, stream_id: int, kind: int, payload: bytes) -> None:
        stream = self.streams.get(stream_id)
        if kind == OPEN:
            remote_parity = 0 if self.dialer else 1
            if stream is not None or stream_id % 2 != remote_parity or len(payload) > _MAX_NAME_BYTES:
                raise ConnectionError(f"{self.peer} opened stream {stream_id} against the protocol")
            try:
                name = payload.decode()
            except UnicodeDecodeError:
                name = ""
            if len(self.streams) >= MAX_STREAMS or not self._served(name):
                self.send(RESET, stream_id)
                return
            stream = MuxStream(self, stream_id)
            self.streams[stream_id] = stream
            self._on_stream(name, stream)
        elif stream is None:
            return  # a stream we already forgot (aborted, or both sides ended): late frames are harmless
        elif kind == DATA:
            stream._feed(payload)
        elif kind == FIN:
            stream._feed_eof()
        elif kind == RESET:
            stream._fail(ConnectionResetError(f"{self.peer} reset the stream"))
            self.forget(stream)
        elif kind == WINDOW:
            if len(payload) != 4:
                raise ConnectionError(f"window update of {len(payload)} bytes from {self.peer}")
            stream._grant(struct.unpack(">I", payload)[0])
        else:
            raise ConnectionError(f"frame kind {kind} from {self.peer}")
