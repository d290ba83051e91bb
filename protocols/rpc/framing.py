"""Messages on a stream: a msgpack header plus a payload of any length, carried by frames of
:mod:`protocols.wire` (chunked above :data:`CHUNK_BYTES`), each size checked before it is read; the reply envelope
of a call; frames of agreed sizes for pipelined calls (:func:`protocols.rpc.call_framed`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

from protocols.interfaces import StreamReader, StreamWriter
from protocols.rpc.errors import Refused, Unreachable
from protocols.wire import ProtocolViolation, StreamEnded, read_header, read_payload, write_frame


#: Default largest payload of one frame; longer payloads are chunked. A payload up to this size is received without
#: a copy (a chunked one is copied once, into its buffer), and its message is byte for byte the single frame that
#: peers spoke before chunking existed.
CHUNK_BYTES = 64 << 20

#: Largest total payload a message may announce (msgpack's unsigned 64-bit range is larger; this keeps it signed).
MAX_TOTAL_BYTES = 2**63 - 1

_REPLY_KEYS = frozenset({"status", "code", "reason"})

#: A payload: one bytes-like object, or several sent back to back as one payload (never joined in memory).
Payload = Union[bytes, bytearray, memoryview, Sequence[Union[bytes, bytearray, memoryview]]]


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
