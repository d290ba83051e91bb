"""The calling side: one request/response exchange (:func:`call`), a pipelined one with agreed frame sizes
(:func:`call_framed`) and a stream of messages (:func:`open_stream`)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterable, Callable, Iterable, Optional, Sequence, Union

from protocols.interfaces import PeerStreams, StreamReader, StreamWriter
from protocols.rpc.errors import _guard
from protocols.rpc.framing import (
    CHUNK_BYTES, Message, Payload, Reply, _buffers, _check_framing, _check_keys, _head_of, _read_head,
    _reply_message, handler_name,
)
from protocols.rpc.stream import RpcStream, _open, _send_first, close_writer
from protocols.wire import ProtocolViolation, read_header, read_payload, write_frame


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
        return await _send_first(RpcStream(reader, writer, peer, caller=True, chunk_bytes=chunk_bytes), request,
                                 payload, None)

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

async def call_framed(
    streams: PeerStreams,
    peer: str,
    service: str,
    method: str,
    header: Optional[dict[str, Any]],
    frames: Union[Iterable[Payload], AsyncIterable[Payload]],
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
    the transport), of exactly ``sizes`` bytes; an async iterable may wait for what a frame carries (a ring member
    relays what its other neighbour sends); the reply must arrive framed as ``reply_sizes`` (bytes), and
    ``on_reply_frame(k, payload)`` is called for each reply frame in order as it arrives. On the wire both are
    ordinary messages of :mod:`protocols.rpc` (one frame: unchunked; several: ``_total`` then continuation frames), so a
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

    async def payloads() -> Any:
        if isinstance(frames, AsyncIterable):
            async for payload in frames:
                yield payload
        else:
            for payload in frames:
                yield payload

    async def send(writer: StreamWriter) -> None:
        source = payloads()
        try:
            i = 0
            async for payload in source:  # as zip(frames, sizes): the source runs to its end after its last frame
                if i == len(sizes):
                    break
                views = _buffers(payload)
                if sum(v.nbytes for v in views) != sizes[i]:
                    raise ValueError(f"request frame {i} holds {sum(v.nbytes for v in views)} bytes, not {sizes[i]}")
                counts[0] += await write_frame(writer, _head_of(request, sizes) if i == 0 else {}, views)
                i += 1
        finally:
            await source.aclose()

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
            close_writer(writer)

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
    return await _send_first(stream, {**_check_keys(header), "_stream": True}, payload, timeout_s)
