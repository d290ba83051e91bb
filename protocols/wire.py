"""Framing of protocol messages on a byte stream: a msgpack header plus an optional raw payload.

Frame layout (all integers big-endian)::

    u32 header_length | u32 payload_length | header (msgpack map) | payload (raw bytes)

The header length is checked right after the 8-byte prefix and the payload length before any payload byte is read,
so a peer that announces an oversized frame costs us at most the prefix plus a bounded header, not the frame. Everything a peer sends is untrusted: every failure to parse raises
:class:`ProtocolViolation` (the caller excludes that peer), never anything else.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

from protocols.interfaces import StreamReader, StreamWriter

_PREFIX = struct.Struct(">II")
#: Largest msgpack header accepted from a peer, in bytes.
MAX_HEADER_BYTES = 64 * 1024


class RpcError(Exception):
    """Base of every failure of an exchange with a peer (see :mod:`protocols.rpc` for the subclasses)."""


class ProtocolViolation(RpcError):
    """A peer sent bytes that do not follow the protocol (oversized, truncated, malformed, wrong schema).

    Raised on the side that read the bytes; the caller excludes (bans) that peer.
    """


class StreamEnded(ProtocolViolation):
    """The stream ended cleanly before the first byte of a frame (the peer closed between frames).

    A :class:`ProtocolViolation` where a frame was required (so :func:`read_frame` callers see no change);
    :mod:`protocols.rpc` reads it as the peer having gone away, not as garbage.
    """


class StreamCorrupted(ConnectionResetError):
    """The transport found bytes of the stream altered on the path (e.g. a TLS record that failed its
    authentication) and ended the connection. Nothing altered was delivered; the peer at the other end is not at
    fault (an on-path attacker or a broken link is), so callers treat it as a broken stream, never as a reason to
    ban that peer."""


#: Largest payload one frame can carry (its length is a u32); :mod:`protocols.rpc` chunks longer messages.
MAX_FRAME_PAYLOAD_BYTES = 2**32 - 1


def encode_frame(
    header: dict[str, Any], payload: bytes | memoryview | list[bytes | memoryview] = b""
) -> list[bytes | memoryview]:
    """Serialize a frame into buffers ready for ``writer.write`` (the payload is not copied).

    ``payload`` may be a list of buffers, sent back to back as one payload (e.g. the slices of one chunk).
    Raises ValueError if the header exceeds :data:`MAX_HEADER_BYTES` or the payload one frame's u32 length.
    """
    header_bytes = msgpack.packb(header, use_bin_type=True)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header is {len(header_bytes)} bytes, more than {MAX_HEADER_BYTES}")
    parts = payload if isinstance(payload, list) else [payload]
    length = sum(memoryview(p).nbytes for p in parts)
    if length > MAX_FRAME_PAYLOAD_BYTES:
        raise ValueError(f"frame payload is {length} bytes, more than {MAX_FRAME_PAYLOAD_BYTES}: chunk it")
    return [_PREFIX.pack(len(header_bytes), length), header_bytes, *parts]


async def write_frame(
    writer: StreamWriter, header: dict[str, Any], payload: bytes | memoryview | list[bytes | memoryview] = b""
) -> int:
    """Write one frame and wait until the transport accepted it. Returns the number of bytes written."""
    total = 0
    for buffer in encode_frame(header, payload):
        size = memoryview(buffer).nbytes
        if size:
            writer.write(buffer)
            total += size
    await writer.drain()
    return total


async def try_write_frame(writer: StreamWriter, header: dict[str, Any], timeout_s: float = 5.0) -> bool:
    """Best-effort answer (an error or refusal to a peer that may already be gone); True if it was written."""
    try:
        await asyncio.wait_for(write_frame(writer, header), timeout_s)
        return True
    except (ConnectionError, OSError, asyncio.TimeoutError):
        return False


async def read_frame(reader: StreamReader, max_payload_bytes: int) -> tuple[dict[str, Any], bytes, int]:
    """Read one frame; returns ``(header, payload, bytes_read)``.

    Raises:
        ProtocolViolation: header or payload larger than allowed, stream ended mid-frame, header not a msgpack map.
    """
    header, payload_length, header_bytes = await read_header(reader)
    if payload_length > max_payload_bytes:
        raise ProtocolViolation(f"payload of {payload_length} bytes exceeds the limit of {max_payload_bytes}")
    payload = await read_payload(reader, payload_length)
    return header, payload, header_bytes + payload_length


async def read_header(reader: StreamReader) -> tuple[dict[str, Any], int, int]:
    """Read a frame's prefix and header, not its payload: returns ``(header, payload_length, bytes_read)``.

    The caller must check ``payload_length`` against what it expects, then call :func:`read_payload`.
    """
    try:
        prefix = await reader.readexactly(_PREFIX.size)
    except asyncio.IncompleteReadError as e:
        kind = StreamEnded if not e.partial else ProtocolViolation
        raise kind(f"stream ended after {len(e.partial)} of {_PREFIX.size} prefix bytes") from None
    header_length, payload_length = _PREFIX.unpack(prefix)
    if header_length > MAX_HEADER_BYTES:
        raise ProtocolViolation(f"header of {header_length} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        header_bytes = await reader.readexactly(header_length)
    except asyncio.IncompleteReadError as e:
        raise ProtocolViolation(f"stream ended mid-header ({len(e.partial)} of {header_length} bytes)") from None
    try:
        header = msgpack.unpackb(header_bytes, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except Exception as e:  # noqa: BLE001 - boundary: a peer's bytes in msgpack's parser, which raises several
        # unrelated types on garbage (ExtraData, FormatError, StackError, ValueError, TypeError...): all a violation
        raise ProtocolViolation(f"malformed msgpack header: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolViolation(f"frame header must be a map, got {type(header).__name__}")
    _check_plain(header)
    return header, payload_length, _PREFIX.size + header_length


async def read_payload(reader: StreamReader, payload_length: int) -> bytes:
    """Read a payload whose length :func:`read_header` returned (and the caller accepted)."""
    if not payload_length:
        return b""
    try:
        return await reader.readexactly(payload_length)
    except asyncio.IncompleteReadError as e:
        raise ProtocolViolation(f"stream ended mid-payload ({len(e.partial)} of {payload_length} bytes)") from None


_PLAIN = (str, bytes, int, float, bool, type(None))


def _check_plain(value: Any, depth: int = 0) -> None:
    """Headers hold only maps, lists and scalars (no msgpack extensions such as timestamps), nested at most 16 deep."""
    if depth > 16:
        raise ProtocolViolation("frame header nested too deeply")
    if isinstance(value, dict):
        for item in value.values():
            _check_plain(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_plain(item, depth + 1)
    elif not isinstance(value, _PLAIN):
        raise ProtocolViolation(f"frame header holds a {type(value).__name__}, not a plain msgpack value")


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not part of the protocol")


def require(header: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``header[key]`` if present and of type ``kind``; otherwise :class:`ProtocolViolation`."""
    value = header.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise ProtocolViolation(f"field {key!r} must be {kind}, got {type(value).__name__}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)
