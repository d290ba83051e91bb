"""Request/response and streaming RPC between peers, on any :class:`protocols.interfaces.PeerStreams`.

Every protocol of peerd (matchmaking, all-reduce, gossip, state transfer, pipeline stages next) talks through this
module: a :class:`Service` serves methods, :func:`call` makes one request/response exchange and :func:`open_stream`
opens a bidirectional stream of messages. Failures are typed, so callers never parse strings: every one is an
:class:`RpcError`, one subclass per failure class:

- :class:`RpcTimeout`: the exchange did not finish within its time limit;
- :class:`Unreachable`: no stream could be opened, or the stream broke or was closed between messages (the peer is
  gone; not evidence of malice);
- :class:`ProtocolViolation` (from :mod:`protocols.wire`): the peer sent bytes that break the protocol (oversized,
  truncated mid-message, malformed); raised on the side that read them, which excludes (bans) that peer;
- :class:`Refused`: the remote answered with a refusal (``code`` says which kind, ``reason`` says why); a handler
  that raises becomes a refusal on the caller, never a hung caller.

**How a message travels.** A stream is opened to the handler name ``<service>.<method>`` (e.g. ``run.reduce``).
A *message* is a msgpack header plus a payload of any length (up to 2**63 bytes), carried by frames of
:mod:`protocols.wire` (``u32 header_length | u32 payload_length | header | payload``). A payload of at most
``chunk_bytes`` rides in one frame: the message is that frame, byte for byte. A longer payload is chunked: the
first frame's header gets ``"_total": <payload bytes>`` (a 64-bit msgpack integer) and carries the first chunk;
continuation frames have an empty header ``{}`` and carry the next chunks, until ``_total`` bytes have arrived.
The reader checks every size before reading it: ``_total`` (or the single frame's length) against the limit the
receiving code set for that message, the first chunk against ``_total``, each continuation chunk against what
remains; it allocates the payload only after the checks.

A call is the request message, then one reply message whose header has ``"status"``: ``"ok"`` (the handler's
header fields sit beside it), or ``"refused"`` with ``"code"`` and ``"reason"``. A stream is a request whose header
has ``"_stream": true``; then both sides send messages in any order; the handler's side ends with a
``{"status": "end"}`` message (or a refusal), the caller's side with ``{"_end": true}``. Keys ``status``, ``code``,
``reason`` and every key starting with ``_`` are the envelope's: handlers and callers may not use them.

Closing: the caller closes its stream once it has read the last message it expects; a handler's side returns and
the transport closes it. (Transports on which closing first can drop the last answer, such as p2pd's yamux, keep
the handler's side open until the caller closed: see :mod:`peerd.transport.linger`.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Optional, Sequence, Union

from protocols.interfaces import PeerStreams, StreamHandler, StreamReader, StreamWriter
from protocols.wire import (
    ProtocolViolation,
    RpcError,
    StreamEnded,
    read_header,
    read_payload,
    try_write_frame,
    write_frame,
)

__all__ = [
    "CHUNK_BYTES", "Message", "ProtocolViolation", "Refused", "Reply", "Request", "RpcError", "RpcStream",
    "RpcTimeout", "Service", "Unreachable", "call", "call_framed", "handler_name", "open_stream", "until",
]

logger = logging.getLogger(__name__)

#: Default largest payload of one frame; longer payloads are chunked. A payload up to this size is received without
#: a copy (a chunked one is copied once, into its buffer), and its message is byte for byte the single frame that
#: peers spoke before chunking existed.
CHUNK_BYTES = 64 << 20

#: Largest total payload a message may announce (msgpack's unsigned 64-bit range is larger; this keeps it signed).
MAX_TOTAL_BYTES = 2**63 - 1

_REPLY_KEYS = frozenset({"status", "code", "reason"})

#: A payload: one bytes-like object, or several sent back to back as one payload (never joined in memory).
Payload = Union[bytes, bytearray, memoryview, Sequence[Union[bytes, bytearray, memoryview]]]


class RpcTimeout(RpcError):
    """The exchange did not finish within its time limit."""


class Unreachable(RpcError):
    """No stream could be opened to the peer, or the stream broke or was closed between messages."""


class Refused(RpcError):
    """The remote answered with a refusal. Handlers raise it to refuse; callers receive it with the same fields.

    Args:
        reason: human-readable why (logged, never parsed).
        code: machine-readable kind, e.g. ``"refused"``, ``"busy"``, ``"unavailable"``; the dispatcher itself uses
            ``"protocol"`` (bad request), ``"timeout"`` (request not delivered in time) and ``"internal"`` (the
            handler failed).
    """

    def __init__(self, reason: str, code: str = "refused"):
        super().__init__(f"{code}: {reason}")
        self.reason = reason
        self.code = code


def handler_name(service: str, method: str) -> str:
    """The stream handler name of ``method`` of ``service``: ``<service>.<method>``."""
    return f"{service}.{method}"


# ----------------------------------------------------------------------------------------------------- messages


@dataclass
class Message:
    """One received message: ``header`` (envelope keys removed), ``payload`` and ``nbytes`` read off the stream."""

    header: dict[str, Any]
    payload: Union[bytes, bytearray]
    nbytes: int


@dataclass
class Reply(Message):
    """A call's answer: the reply message plus ``bytes_sent`` (the request as written)."""

    bytes_sent: int = 0


def _buffers(payload: Payload) -> list[memoryview]:
    parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
    views = []
    for part in parts:
        view = memoryview(part)
        if not view.contiguous:
            raise ValueError("payload buffers must be contiguous")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if view.nbytes:
            views.append(view)
    return views


def _chunks(views: list[memoryview], chunk_bytes: int) -> Iterable[list[memoryview]]:
    """Slices of ``views`` (no copies) grouped into chunks of at most ``chunk_bytes`` bytes."""
    chunk: list[memoryview] = []
    room = chunk_bytes
    for view in views:
        while view.nbytes:
            take = min(room, view.nbytes)
            chunk.append(view[:take])
            view, room = view[take:], room - take
            if room == 0:
                yield chunk
                chunk, room = [], chunk_bytes
    if chunk:
        yield chunk


async def send_message(writer: StreamWriter, header: dict[str, Any], payload: Payload = b"",
                       chunk_bytes: int = CHUNK_BYTES) -> int:
    """Write one message (chunked if its payload exceeds ``chunk_bytes``); returns the bytes written.

    Raises ConnectionError/OSError from the transport; ValueError on a header that holds a reserved key.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    views = _buffers(payload)
    total = sum(v.nbytes for v in views)
    if total <= chunk_bytes:
        return await write_frame(writer, header, views)
    written = 0
    for i, chunk in enumerate(_chunks(views, chunk_bytes)):
        written += await write_frame(writer, {**header, "_total": total} if i == 0 else {}, chunk)
    return written


async def _read_head(reader: StreamReader) -> tuple[dict[str, Any], int, int, int]:
    """A message's first frame header: ``(header, total, first_chunk_length, bytes_read)``; payload not read.

    Raises Unreachable if the stream ended before the message; ProtocolViolation on a malformed head.
    """
    try:
        header, length, nbytes = await read_header(reader)
    except StreamEnded as e:
        raise Unreachable(f"the peer closed the stream: {e}") from None
    total = header.pop("_total", None)
    if total is None:
        return header, length, length, nbytes
    if not isinstance(total, int) or isinstance(total, bool) or not 0 < length < total <= MAX_TOTAL_BYTES:
        raise ProtocolViolation(f"chunked message of {total!r} bytes with a first chunk of {length}")
    return header, total, length, nbytes


async def _read_body(reader: StreamReader, total: int, first: int, max_bytes: int) -> tuple[Union[bytes, bytearray], int]:
    """The payload whose head :func:`_read_head` read: ``(payload, bytes_read)``. Checks ``total <= max_bytes``
    before reading any payload byte and each continuation chunk against what remains before reading it."""
    if total > max_bytes:
        raise ProtocolViolation(f"payload of {total} bytes exceeds the limit of {max_bytes}")
    if total == first:
        return await read_payload(reader, first), first
    buffer = bytearray(total)
    view = memoryview(buffer)
    view[:first] = await read_payload(reader, first)
    filled, nbytes = first, first
    while filled < total:
        header, length, header_bytes = await read_header(reader)
        if header:
            raise ProtocolViolation(f"continuation frame with a header {sorted(header)}")
        if not 0 < length <= total - filled:
            raise ProtocolViolation(f"chunk of {length} bytes with {total - filled} of {total} remaining")
        view[filled:filled + length] = await read_payload(reader, length)
        filled += length
        nbytes += header_bytes + length
    return buffer, nbytes


async def read_message(reader: StreamReader, max_bytes: int) -> Message:
    """Read one whole message whose payload may be at most ``max_bytes``.

    Raises Unreachable (stream ended before the message), ProtocolViolation (oversized, truncated, malformed).
    """
    header, total, first, nbytes = await _read_head(reader)
    payload, body = await _read_body(reader, total, first, max_bytes)
    return Message(header, payload, nbytes + body)


def _check_keys(header: Optional[dict[str, Any]]) -> dict[str, Any]:
    header = dict(header or {})
    bad = [k for k in header if not isinstance(k, str) or k.startswith("_") or k in _REPLY_KEYS]
    if bad:
        raise ValueError(f"header keys {bad} are reserved for the RPC envelope")
    return header


def _reply_message(message: Message) -> Optional[Message]:
    """Interpret a message from a handler: the message (ok), None (end of stream); raises Refused or
    ProtocolViolation."""
    status = message.header.pop("status", None)
    if status == "ok":
        return message
    if status == "end":
        return None
    if status == "refused":
        code, reason = message.header.get("code", "refused"), message.header.get("reason", "")
        raise Refused(str(reason)[:1000], str(code)[:64])
    raise ProtocolViolation(f"reply status {status!r} is not ok, refused or end")


async def until(awaitable: Awaitable[Any], deadline: Optional[float]) -> Any:
    """Await ``awaitable`` until ``deadline`` (event-loop time; None: no deadline). Raises asyncio.TimeoutError past
    it. On Python 3.11+ this is one timer (``asyncio.timeout_at``), no task: cheap enough to bound a whole pipelined
    exchange where a ``wait_for`` per step would cost a task and a timer per frame; older Pythons use ``wait_for``."""
    if deadline is None:
        return await awaitable
    timeout_at = getattr(asyncio, "timeout_at", None)
    if timeout_at is None:
        return await asyncio.wait_for(awaitable, max(deadline - asyncio.get_running_loop().time(), 0.0))
    async with timeout_at(deadline):
        return await awaitable


async def _guard(awaitable: Awaitable[Any], timeout_s: Optional[float], what: str) -> Any:
    """Await with an optional deadline and map transport failures onto the RPC error classes."""
    try:
        if timeout_s is None:
            return await awaitable
        return await asyncio.wait_for(awaitable, max(timeout_s, 0.0))
    except asyncio.TimeoutError:
        raise RpcTimeout(f"{what} did not finish within {timeout_s} s") from None
    except (ConnectionError, OSError) as e:
        raise Unreachable(f"{what}: {type(e).__name__}: {e}") from e


# -------------------------------------------------------------------------------------------------------- streams


class RpcStream:
    """One side of an RPC stream: messages in both directions, each of any size (chunked on the wire).

    The caller's side comes from :func:`open_stream`; a handler's side is :attr:`Request.stream`. ``recv`` returns
    None once the other side ended its messages. ``bytes_sent`` / ``bytes_received`` count every byte.
    """

    def __init__(self, reader: StreamReader, writer: StreamWriter, peer: str, *, caller: bool,
                 chunk_bytes: int = CHUNK_BYTES):
        self.reader, self.writer, self.peer = reader, writer, peer
        self.caller = caller
        self.chunk_bytes = chunk_bytes
        self.bytes_sent = 0
        self.bytes_received = 0
        self._remote_ended = False

    async def send(self, header: Optional[dict[str, Any]] = None, payload: Payload = b"",
                   timeout_s: Optional[float] = None) -> int:
        """Send one message; returns its bytes. Raises RpcTimeout, Unreachable; ValueError on reserved keys."""
        header = _check_keys(header)
        if not self.caller:
            header = {"status": "ok", **header}
        return await self._send(header, payload, timeout_s)

    async def _send(self, header: dict[str, Any], payload: Payload, timeout_s: Optional[float]) -> int:
        sent = await _guard(send_message(self.writer, header, payload, self.chunk_bytes), timeout_s,
                            f"sending to {self.peer}")
        self.bytes_sent += sent
        return sent

    async def recv(self, max_bytes: int, timeout_s: Optional[float] = None) -> Optional[Message]:
        """The next message (payload at most ``max_bytes``), or None once the other side ended its messages.

        Raises RpcTimeout, Unreachable (stream closed or broken), ProtocolViolation, and on the caller's side
        Refused (the handler refused).
        """
        if self._remote_ended:
            return None
        message = await _guard(read_message(self.reader, max_bytes), timeout_s, f"receiving from {self.peer}")
        self.bytes_received += message.nbytes
        if self.caller:
            message = _reply_message(message)
        elif message.header.pop("_end", None) is True:
            message = None
        if message is None:
            self._remote_ended = True
        return message

    async def end(self, timeout_s: Optional[float] = None) -> None:
        """Tell the other side this one sends no more messages (its ``recv`` then returns None)."""
        await self._send({"status": "end"} if not self.caller else {"_end": True}, b"", timeout_s)

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - closing a broken stream must not raise
            pass

    async def __aenter__(self) -> "RpcStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


async def _open(streams: PeerStreams, peer: str, name: str, timeout_s: Optional[float]) -> tuple[Any, Any]:
    return await _guard(streams.open(peer, name), timeout_s, f"opening {name!r} to {peer}")


async def call(
    streams: PeerStreams,
    peer: str,
    service: str,
    method: str,
    header: Optional[dict[str, Any]] = None,
    payload: Payload = b"",
    *,
    timeout_s: Optional[float],
    max_reply_bytes: int = 0,
    connect_timeout_s: Optional[float] = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Reply:
    """Call ``method`` of ``service`` on ``peer``: send one request, read one reply.

    Args:
        streams: this peer's streams (``transport.streams``).
        header: msgpack-able map of the request (no reserved keys); payload: its raw bytes (any length).
        timeout_s: for the whole exchange (open, send, reply), in seconds; None only where the caller bounds the
            call itself (e.g. inside its own ``asyncio.wait_for``).
        max_reply_bytes: largest reply payload accepted; a larger announced reply is refused on its header, before
            any payload byte is read.
        connect_timeout_s: optional tighter bound on opening the stream and sending the request.
        chunk_bytes: largest payload per frame when sending.

    Returns:
        The :class:`Reply` (header without ``status``, payload, bytes received and sent).

    Raises:
        RpcTimeout, Unreachable, ProtocolViolation (the reply broke the protocol or exceeded ``max_reply_bytes``),
        Refused (the handler refused or failed); ValueError on a reserved key in ``header``.
    """
    request = _check_keys(header)
    name = handler_name(service, method)

    async def connect() -> RpcStream:
        reader, writer = await streams.open(peer, name)
        stream = RpcStream(reader, writer, peer, caller=True, chunk_bytes=chunk_bytes)
        try:
            await stream._send(request, payload, None)
        except BaseException:
            stream.close()
            raise
        return stream

    async def exchange() -> Reply:
        if connect_timeout_s is None:
            stream = await connect()
        else:
            stream = await _guard(connect(), connect_timeout_s, f"opening {name!r} to {peer} and sending the request")
        try:
            message = await stream.recv(max_reply_bytes)
        finally:
            stream.close()
        if message is None:
            raise ProtocolViolation(f"{peer} ended the call without a reply")
        return Reply(message.header, message.payload, stream.bytes_received, stream.bytes_sent)

    # one deadline around the whole exchange (not one per step): fewer event-loop hops per call
    return await _guard(exchange(), timeout_s, f"call {name!r} to {peer}")


def _head_of(header: dict[str, Any], sizes: Sequence[int]) -> dict[str, Any]:
    """The first frame's header of a message framed as ``sizes``: ``_total`` only where there are several frames
    (a one-frame message is byte for byte the unchunked one)."""
    return {**header, "_total": sum(sizes)} if len(sizes) > 1 else header


async def _continuation_header(reader: Any, k: int, size: int) -> tuple[int, int]:
    """Read the header of continuation frame ``k`` of a request framed with ``size`` bytes there; returns (payload
    length, header bytes). Raises ProtocolViolation if the frame carries a header or has another size."""
    header, length, header_bytes = await read_header(reader)
    if header:
        raise ProtocolViolation(f"continuation frame with a header {sorted(header)}")
    if length != size:
        raise ProtocolViolation(f"request frame {k} of {length} bytes, expected {size}")
    return length, header_bytes


def _check_framing(sizes: Sequence[int]) -> None:
    if not sizes or any(s < 0 for s in sizes) or (len(sizes) > 1 and min(sizes) < 1):
        raise ValueError(f"frame sizes must be one size >= 0 or several >= 1, got {list(sizes)[:8]}")


async def call_framed(
    streams: PeerStreams,
    peer: str,
    service: str,
    method: str,
    header: Optional[dict[str, Any]],
    frames: Iterable[Payload],
    sizes: Sequence[int],
    reply_sizes: Sequence[int],
    on_reply_frame: Callable[[int, Union[bytes, bytearray]], None],
    *,
    timeout_s: Optional[float],
) -> tuple[dict[str, Any], int, int]:
    """A call whose request and reply are each one chunked message with *agreed* frame sizes, both directions at
    once: the request's frames are written while the reply's frames are read, so a handler can answer frame k as
    soon as it has what it needs (a pipeline, e.g. a streaming all-reduce reducer).

    ``frames`` yields the request's frame payloads lazily (one is produced only once the previous one was handed to
    the transport), of exactly ``sizes`` bytes; the reply must arrive framed as ``reply_sizes`` (bytes), and
    ``on_reply_frame(k, payload)`` is called for each reply frame in order as it arrives. On the wire both are
    ordinary messages of this module (one frame: unchunked; several: ``_total`` then continuation frames), so a
    handler may also read the request with :meth:`Request.payload` and answer with :meth:`Request.reply`.

    Returns ``(reply header, bytes sent, bytes received)``. Raises RpcTimeout (``timeout_s`` bounds the whole
    exchange), Unreachable, ProtocolViolation (the reply is framed otherwise than ``reply_sizes`` or malformed),
    Refused (also when a refusal arrives in place of a later reply frame); whatever ``frames`` or
    ``on_reply_frame`` raise (e.g. ValueError) propagates.
    """
    _check_framing(sizes)
    _check_framing(reply_sizes)
    request = _check_keys(header)
    name = handler_name(service, method)
    counts = [0, 0]  # bytes sent, received

    async def send(writer: StreamWriter) -> None:
        for i, (payload, size) in enumerate(zip(frames, sizes)):
            views = _buffers(payload)
            if sum(v.nbytes for v in views) != size:
                raise ValueError(f"request frame {i} holds {sum(v.nbytes for v in views)} bytes, not {size}")
            counts[0] += await write_frame(writer, _head_of(request, sizes) if i == 0 else {}, views)

    async def receive(reader: StreamReader) -> dict[str, Any]:
        head, total, first, nbytes = await _read_head(reader)
        reply = _reply_message(Message(head, b"", nbytes))
        if total != sum(reply_sizes) or first != reply_sizes[0]:
            raise ProtocolViolation(f"reply of {total} bytes in a first frame of {first}, expected "
                                    f"{sum(reply_sizes)} in {reply_sizes[0]}")
        on_reply_frame(0, await read_payload(reader, first))
        counts[1] += nbytes + first
        for k, size in enumerate(reply_sizes[1:], 1):
            frame, length, header_bytes = await read_header(reader)
            if frame:  # a refusal in place of the next frame: the handler gave up on us mid-answer
                _reply_message(Message(frame, b"", header_bytes))
                raise ProtocolViolation(f"continuation frame with a header {sorted(frame)}")
            if length != size:
                raise ProtocolViolation(f"reply frame {k} of {length} bytes, expected {size}")
            on_reply_frame(k, await read_payload(reader, length))
            counts[1] += header_bytes + length
        return reply.header

    async def exchange() -> dict[str, Any]:
        reader, writer = await streams.open(peer, name)
        sender = asyncio.ensure_future(send(writer))
        try:
            receiver = asyncio.ensure_future(receive(reader))
            try:
                await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
                if sender.done() and sender.exception() is not None:
                    error = sender.exception()
                    if not isinstance(error, (ConnectionError, OSError)):
                        raise error  # a local failure (e.g. encoding): the handler would wait for us in vain
                    # the handler closed or refused: its answer (a refusal) says more than our broken pipe
                reply = await receiver
            finally:
                receiver.cancel()
            await sender  # the handler answered every frame: our request is long written
            return reply
        finally:
            sender.cancel()
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - closing a broken stream must not raise
                pass

    header_out = await _guard(exchange(), timeout_s, f"call {name!r} to {peer}")
    return header_out, counts[0], counts[1]


async def open_stream(
    streams: PeerStreams,
    peer: str,
    service: str,
    method: str,
    header: Optional[dict[str, Any]] = None,
    payload: Payload = b"",
    *,
    timeout_s: float,
    chunk_bytes: int = CHUNK_BYTES,
) -> RpcStream:
    """Open a stream to ``method`` of ``service`` on ``peer`` and send its first message (``header``, ``payload``).

    Use as ``async with await open_stream(...) as s:``; then ``s.send`` / ``s.recv`` / ``s.end``. ``timeout_s``
    bounds opening and sending the first message. Raises RpcTimeout, Unreachable; ValueError on reserved keys.
    """
    reader, writer = await _open(streams, peer, handler_name(service, method), timeout_s)
    stream = RpcStream(reader, writer, peer, caller=True, chunk_bytes=chunk_bytes)
    try:
        await stream._send({**_check_keys(header), "_stream": True}, payload, timeout_s)
    except BaseException:
        stream.close()
        raise
    return stream


# -------------------------------------------------------------------------------------------------------- serving


class Request:
    """What a handler receives: the caller's PeerID, the request header, its payload (read on demand).

    ``size`` is the payload length the caller announced: a handler checks it before :meth:`payload` reads it.
    """

    def __init__(self, peer: str, header: dict[str, Any], size: int, first: int, stream: RpcStream,
                 is_stream: bool, head_bytes: int):
        self.peer, self.header, self.size = peer, header, size
        self.stream = stream
        self.is_stream = is_stream
        self.head_bytes = head_bytes
        self.replied = False
        self._first = first
        self._payload: Optional[Union[bytes, bytearray]] = None

    async def payload(self, max_bytes: int, timeout_s: Optional[float] = None) -> Union[bytes, bytearray]:
        """The request payload (read once, then cached). Raises ProtocolViolation if ``size > max_bytes`` (before
        reading) or on a truncated/malformed payload, RpcTimeout, Unreachable."""
        if self._payload is None:
            if self.size > max_bytes:
                raise ProtocolViolation(f"payload of {self.size} bytes exceeds the limit of {max_bytes}")
            self._payload, nbytes = await _guard(
                _read_body(self.stream.reader, self.size, self._first, max_bytes), timeout_s,
                f"reading the request of {self.peer}")
            self.stream.bytes_received += nbytes
        return self._payload

    def _claim_framed_payload(self, sizes: Sequence[int]) -> None:
        """Check that the request was framed as ``sizes`` and mark its payload consumed (payload() may not read it
        again). Raises ProtocolViolation, RuntimeError if the payload was already read."""
        _check_framing(sizes)
        if self._payload is not None:
            raise RuntimeError("the payload was already read")
        if self.size != sum(sizes) or self._first != sizes[0]:
            raise ProtocolViolation(f"payload of {self.size} bytes in a first frame of {self._first}, expected "
                                    f"{sum(sizes)} in {sizes[0]}")
        self._payload = b""

    async def payload_frames(self, sizes: Sequence[int],
                             deadline: Optional[float] = None) -> AsyncIterator[Union[bytes, bytearray]]:
        """The request payload frame by frame, for a caller that framed it as ``sizes`` (:func:`call_framed`).

        Checks the announced total and every frame's size before reading it. ``deadline`` (event loop time) bounds
        the whole read. Raises ProtocolViolation (framed otherwise, truncated, malformed), RpcTimeout, Unreachable.
        """
        self._claim_framed_payload(sizes)
        loop = asyncio.get_running_loop()
        reader, what = self.stream.reader, f"reading the request of {self.peer}"

        def left() -> Optional[float]:
            return None if deadline is None else deadline - loop.time()

        data = await _guard(read_payload(reader, sizes[0]), left(), what)
        self.stream.bytes_received += sizes[0]
        yield data
        for k, size in enumerate(sizes[1:], 1):
            length, header_bytes = await _guard(_continuation_header(reader, k, size), left(), what)
            data = await _guard(read_payload(reader, length), left(), what)
            self.stream.bytes_received += header_bytes + length
            yield data

    async def read_frames(self, sizes: Sequence[int], on_frame: Callable[[int, Union[bytes, bytearray]], None],
                          deadline: Optional[float] = None,
                          extend: Optional[Callable[[int], Optional[float]]] = None) -> None:
        """Read the request payload framed as ``sizes`` (:func:`call_framed`), calling ``on_frame(k, payload)`` for
        each frame in order as it arrives: :meth:`payload_frames` with one timer for the whole read instead of one
        per frame (a pipelined reader pays the event loop per frame, so this matters per byte).

        Checks the announced total and every frame's size before reading it. ``deadline`` (event loop time) bounds
        the whole read; ``extend(k)``, called after frame k was handled, may return a new deadline (a reader that
        gives a sender which keeps its pace more time). Raises ProtocolViolation (framed otherwise, truncated,
        malformed), RpcTimeout, Unreachable; whatever ``on_frame`` or ``extend`` raise propagates.
        """
        self._claim_framed_payload(sizes)
        reader = self.stream.reader
        timeout_at = getattr(asyncio, "timeout_at", None)
        scope = None  # the one timer of the read (Python 3.11+); older Pythons bound each frame by the deadline
        current = deadline

        async def frame(k: int, length: int, header_bytes: int) -> None:
            nonlocal current
            on_frame(k, await read_payload(reader, length))
            self.stream.bytes_received += header_bytes + length
            moved = extend(k) if extend is not None else None
            if moved is not None and moved != current:
                current = moved
                if scope is not None:
                    scope.reschedule(moved)

        def bounded(step: Awaitable[Any]) -> Awaitable[Any]:
            """``step`` under the current deadline where no one timer bounds the whole read."""
            return step if scope is not None or current is None else until(step, current)

        async def read_all() -> None:
            await bounded(frame(0, sizes[0], 0))
            for k, size in enumerate(sizes[1:], 1):
                length, header_bytes = await bounded(_continuation_header(reader, k, size))
                await bounded(frame(k, length, header_bytes))

        what = f"reading the request of {self.peer}"
        try:
            if deadline is not None and timeout_at is not None:
                async with timeout_at(deadline) as scope:
                    await read_all()
            else:
                await read_all()
        except asyncio.TimeoutError:
            raise RpcTimeout(f"{what} did not finish by its deadline") from None
        except (ConnectionError, OSError) as e:
            raise Unreachable(f"{what}: {type(e).__name__}: {e}") from e

    async def reply_frame(self, k: int, sizes: Sequence[int], payload: Payload,
                          header: Optional[dict[str, Any]] = None, timeout_s: Optional[float] = None) -> int:
        """Write frame ``k`` of an answer framed as ``sizes`` (frames in order; ``header`` goes with frame 0);
        returns the bytes written. Raises RpcTimeout, Unreachable; ValueError on a frame of the wrong size."""
        views = _buffers(payload)
        if sum(v.nbytes for v in views) != sizes[k]:
            raise ValueError(f"reply frame {k} holds {sum(v.nbytes for v in views)} bytes, not {sizes[k]}")
        if k == 0:
            if self.replied:
                raise RuntimeError("this request was already answered")
            self.replied = True
            head = _head_of({"status": "ok", **_check_keys(header)}, sizes)
        else:
            head = {}
        written = await _guard(write_frame(self.stream.writer, head, views), timeout_s, f"answering {self.peer}")
        self.stream.bytes_sent += written
        return written

    async def reply(self, header: Optional[dict[str, Any]] = None, payload: Payload = b"",
                    timeout_s: Optional[float] = None) -> int:
        """Answer a call now (instead of returning the answer); returns the bytes written.

        Raises RpcTimeout, Unreachable; RuntimeError if already answered.
        """
        if self.replied:
            raise RuntimeError("this request was already answered")
        self.replied = True
        return await self.stream.send(header, payload, timeout_s)

    async def remote_closed(self) -> None:
        """Return once the caller's side of a call is closed or broken (a caller sends nothing after its request,
        so any further byte counts as closed too). Reads the stream: do not use with :meth:`payload` pending."""
        try:
            await self.stream.reader.readexactly(1)
        except Exception:  # noqa: BLE001 - EOF, reset: all mean closed
            pass


#: A method handler: ``await handler(request)`` -> None (answered via request.reply / a stream), a header dict,
#: or ``(header, payload)``. Raising Refused refuses; any other exception is a refusal with code "internal".
MethodHandler = Callable[[Request], Awaitable[Any]]


class Service:
    """A named set of methods served on peer streams; each method is a stream handler ``<name>.<method>``.

    Subclasses set :attr:`name` and define ``async def rpc_<method>(self, request)`` (or override
    :meth:`methods` to return a table). :meth:`start` registers every method, :meth:`stop` removes them.
    A request head must arrive within :attr:`request_timeout_s`; a head that is late or malformed is reported to
    :meth:`on_bad_request` (where a protocol bans the peer) and refused.
    """

    name: str = ""
    request_timeout_s: float = 30.0
    chunk_bytes: int = CHUNK_BYTES
    transport: Any = None

    def methods(self) -> dict[str, MethodHandler]:
        """``{method: handler}``; by default every ``rpc_<method>`` of this object (looked up once)."""
        table = self.__dict__.get("_methods")
        if table is None:
            table = {attr[4:]: getattr(self, attr) for attr in dir(type(self)) if attr.startswith("rpc_")}
            self.__dict__["_methods"] = table
        return table

    def handler_name_of(self, method: str) -> str:
        return handler_name(self.name, method)

    def stream_handler(self, method: str) -> StreamHandler:
        """The stream handler registered for ``method`` (a seam for wrappers and tests)."""
        return functools.partial(self.serve, method)

    async def start(self, transport: Any = None) -> None:
        """Serve every method on ``transport.streams`` (or on ``transport`` itself if it is a PeerStreams; by
        default on :attr:`transport`). Raises ValueError if a handler name is already served."""
        target = transport if transport is not None else self.transport
        streams = getattr(target, "streams", target)
        registered: list[str] = []
        try:
            for method in self.methods():
                name = self.handler_name_of(method)
                await streams.add_handler(name, self.stream_handler(method))
                registered.append(name)
        except BaseException:
            for name in registered:
                await streams.remove_handler(name)
            raise
        self._served = (streams, registered)

    async def stop(self) -> None:
        """Stop serving (no-op if not started)."""
        streams, registered = getattr(self, "_served", (None, []))
        for name in registered:
            await streams.remove_handler(name)
        self._served = (None, [])

    def on_bad_request(self, peer: str, method: str, error: RpcError) -> None:
        """Called when ``peer`` sent a malformed request (ProtocolViolation) or did not deliver it in time
        (RpcTimeout). Default: log. Protocols override it to ban."""
        logger.warning("bad %s request from %s: %s", self.handler_name_of(method), peer, error)

    async def serve(self, method: str, peer: str, reader: StreamReader, writer: StreamWriter) -> None:
        """Serve one incoming stream of ``method``: read the request head, run the handler, answer."""
        stream = RpcStream(reader, writer, peer, caller=False, chunk_bytes=self.chunk_bytes)
        request: Optional[Request] = None
        try:
            try:
                header, total, first, nbytes = await _guard(_read_head(reader), self.request_timeout_s,
                                                            f"the request head of {peer}")
                stream.bytes_received += nbytes
                is_stream = header.pop("_stream", None) is True
                request = Request(peer, header, total, first, stream, is_stream, nbytes)
            except (ProtocolViolation, RpcTimeout) as e:
                self.on_bad_request(peer, method, e)
                raise
            result = await self.methods()[method](request)
            if isinstance(result, dict):
                result = (result, b"")
            if result is not None:
                await request.reply(*result)
            elif not request.is_stream and not request.replied:
                await request.reply()
            if request.is_stream:
                await stream.end()
        except Refused as e:
            await _try_refuse(writer, e.code, e.reason)
        except ProtocolViolation as e:
            if request is not None:  # raised by the handler while reading: head violations were reported above
                self.on_bad_request(peer, method, e)
            await _try_refuse(writer, "protocol", str(e))
        except (RpcTimeout, asyncio.TimeoutError) as e:  # (TimeoutError is an OSError: before the next clause)
            await _try_refuse(writer, "timeout", str(e) or "handler timed out")
        except (Unreachable, ConnectionError, OSError) as e:
            logger.debug("%s: %s went away: %s", self.handler_name_of(method), peer, e)
        except Exception as e:  # noqa: BLE001 - a handler bug answers the caller instead of hanging it
            logger.exception("handler %s failed for %s", self.handler_name_of(method), peer)
            await _try_refuse(writer, "internal", f"{type(e).__name__}: {e}")


async def _try_refuse(writer: StreamWriter, code: str, reason: str) -> None:
    await try_write_frame(writer, {"status": "refused", "code": code, "reason": reason[:1000]})
