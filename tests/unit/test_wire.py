"""Frame encoding/decoding of protocols.wire on hand-fed asyncio.StreamReaders (no sockets)."""

import asyncio
import struct

import msgpack
import pytest

from protocols.wire import (
    MAX_HEADER_BYTES,
    ProtocolViolation,
    encode_frame,
    read_frame,
    read_header,
    read_payload,
    require,
    write_frame,
)

pytestmark = pytest.mark.timeout(60)

SENTINEL = b"\xde\xad\xbe\xef"


def prefix(header_length: int, payload_length: int) -> bytes:
    return struct.pack(">II", header_length, payload_length)


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    """A StreamReader already holding ``data``; without ``eof`` a further read waits forever."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def run(coro, timeout_s: float = 1.0):
    """Run ``coro`` under a short deadline: a read that waits for bytes that never come is a TimeoutError."""

    async def main():
        return await asyncio.wait_for(coro(), timeout_s)

    return asyncio.run(main())


class ListWriter:
    def __init__(self):
        self.chunks: list[bytes] = []
        self.drained = 0

    def write(self, data):
        self.chunks.append(bytes(data))

    async def drain(self):
        self.drained += 1

    def close(self):
        pass


# ---------------------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("payload", [b"", b"x", bytes(range(256)) * 100])
def test_frame_round_trip(payload):
    header = {"type": "part", "round": 7, "weight": 0.5, "ok": True, "none": None, "ids": ["a", "b"], "raw": b"\x00\x01"}
    writer = ListWriter()

    async def main():
        written = await write_frame(writer, header, memoryview(payload))
        wire = b"".join(writer.chunks)
        assert written == len(wire)
        reader = reader_with(wire + SENTINEL)
        got_header, got_payload, read = await read_frame(reader, max_payload_bytes=len(payload))
        # the frame is consumed exactly: what follows it is still in the stream
        assert await reader.readexactly(len(SENTINEL)) == SENTINEL
        return wire, got_header, got_payload, read

    wire, got_header, got_payload, read = run(main)
    assert got_header == header
    assert got_payload == payload and isinstance(got_payload, bytes)
    assert read == len(wire) == 8 + len(msgpack.packb(header, use_bin_type=True)) + len(payload)
    assert writer.drained == 1


def test_two_frames_back_to_back():
    wire = b"".join(b"".join(map(bytes, encode_frame({"i": i}, bytes([i]) * i))) for i in range(3))

    async def main():
        reader = reader_with(wire)
        return [await read_frame(reader, 10) for _ in range(3)]

    frames = run(main)
    assert [(h["i"], p) for h, p, _ in frames] == [(0, b""), (1, b"\x01"), (2, b"\x02\x02")]


def test_read_header_leaves_the_payload_in_the_stream():
    header, payload = {"k": "v"}, b"payload!"

    async def main():
        reader = reader_with(b"".join(map(bytes, encode_frame(header, payload))))
        got, length, read = await read_header(reader)
        assert (got, length, read) == (header, len(payload), 8 + len(msgpack.packb(header)))
        return await read_payload(reader, length)

    assert run(main) == payload


def test_encode_frame_refuses_an_oversized_header():
    with pytest.raises(ValueError):
        encode_frame({"blob": b"x" * MAX_HEADER_BYTES})
    # just under the limit is fine
    buffers = encode_frame({"blob": b"x" * (MAX_HEADER_BYTES - 100)})
    assert struct.unpack(">II", buffers[0])[0] <= MAX_HEADER_BYTES


# ------------------------------------------------------------------------------------------------------------- limits


def test_oversized_header_fails_after_the_prefix_only():
    """A peer announcing a huge header costs 8 bytes: no header body is awaited (none is ever sent)."""

    async def main():
        reader = reader_with(prefix(MAX_HEADER_BYTES + 1, 0) + SENTINEL, eof=False)
        with pytest.raises(ProtocolViolation, match="header"):
            await read_frame(reader, max_payload_bytes=1 << 30)
        # only the 8 prefix bytes were consumed
        assert await reader.readexactly(len(SENTINEL)) == SENTINEL

    run(main)


def test_largest_allowed_header_length_is_read():
    """The limit is inclusive: a header of exactly MAX_HEADER_BYTES is waited for, not refused."""

    async def main():
        reader = reader_with(prefix(MAX_HEADER_BYTES, 0), eof=False)
        await read_frame(reader, 0)

    with pytest.raises(asyncio.TimeoutError):
        run(main, timeout_s=0.2)


def test_oversized_payload_fails_before_the_payload_is_read():
    header = msgpack.packb({"type": "state"})

    async def main():
        # no payload bytes are ever sent, and the stream stays open: failing means not waiting for them
        reader = reader_with(prefix(len(header), 1001) + header + SENTINEL, eof=False)
        with pytest.raises(ProtocolViolation, match="1001"):
            await read_frame(reader, max_payload_bytes=1000)
        assert await reader.readexactly(len(SENTINEL)) == SENTINEL

    run(main)


def test_payload_at_the_limit_is_accepted():
    async def main():
        reader = reader_with(b"".join(map(bytes, encode_frame({}, b"p" * 1000))))
        return await read_frame(reader, max_payload_bytes=1000)

    assert run(main)[1] == b"p" * 1000


# ---------------------------------------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("cut", ["prefix", "header", "payload", "empty"])
def test_truncated_frames_are_protocol_violations(cut):
    header = msgpack.packb({"a": 1})
    full = prefix(len(header), 10) + header + b"0123456789"
    data = {
        "empty": b"",
        "prefix": full[:5],
        "header": full[: 8 + len(header) - 1],
        "payload": full[:-1],
    }[cut]

    async def main():
        with pytest.raises(ProtocolViolation, match="stream ended"):
            await read_frame(reader_with(data), max_payload_bytes=100)

    run(main)


# ---------------------------------------------------------------------------------------------------- malformed header


@pytest.mark.parametrize(
    "header_bytes",
    [
        b"\xc1",  # never-used msgpack byte
        b"\xff\xff\xff",  # three negative fixints: trailing data
        msgpack.packb({"a": 1}) + b"\x00",  # a map followed by extra bytes
        b"\x82\xa1a",  # a map of 2 entries cut short
        b"\xd9\x05ab",  # str8 announcing 5 bytes, carrying 2
        msgpack.packb({1: "int key"}),  # strict_map_key: only str/bytes keys
        b"",  # empty header
    ],
)
def test_garbage_msgpack_is_a_protocol_violation(header_bytes):
    async def main():
        with pytest.raises(ProtocolViolation):
            await read_frame(reader_with(prefix(len(header_bytes), 0) + header_bytes), 0)

    run(main)


@pytest.mark.parametrize("value", [[1, 2, 3], "a string", 42, None, b"bytes", 1.5, True])
def test_header_that_is_not_a_map_is_a_protocol_violation(value):
    header_bytes = msgpack.packb(value, use_bin_type=True)

    async def main():
        with pytest.raises(ProtocolViolation, match="must be a map"):
            await read_frame(reader_with(prefix(len(header_bytes), 0) + header_bytes), 0)

    run(main)


@pytest.mark.parametrize(
    "ext",
    [
        msgpack.ExtType(5, b"x"),
        msgpack.ExtType(42, b"some ext payload"),
        msgpack.Timestamp(1, 0),  # the timestamp extension (code -1)
        msgpack.ExtType(5, b""),  # zero-length ext: max_ext_len=0 alone lets it through
    ],
    ids=["fixext1", "ext8", "timestamp", "empty-ext"],
)
@pytest.mark.parametrize("where", ["value", "nested"])
def test_msgpack_ext_types_are_rejected(ext, where):
    header = {"a": ext} if where == "value" else {"a": [1, {"b": ext}]}
    header_bytes = msgpack.packb(header, use_bin_type=True)

    async def main():
        with pytest.raises(ProtocolViolation):
            await read_frame(reader_with(prefix(len(header_bytes), 0) + header_bytes), 0)

    run(main)


# ------------------------------------------------------------------------------------------------------------- require


def test_require_returns_values_of_the_right_type():
    header = {"i": 3, "f": 0.5, "s": "x", "b": True, "l": [1], "d": {"k": 1}, "raw": b"\x00"}
    assert require(header, "i", int) == 3
    assert require(header, "f", float) == 0.5
    assert require(header, "f", (int, float)) == 0.5
    assert require(header, "i", (int, float)) == 3
    assert require(header, "s", str) == "x"
    assert require(header, "b", bool) is True
    assert require(header, "b", (int, bool)) is True
    assert require(header, "l", list) == [1]
    assert require(header, "d", dict) == {"k": 1}
    assert require(header, "raw", bytes) == b"\x00"


@pytest.mark.parametrize(
    "value, kind",
    [
        (True, int),  # bool is a subclass of int, but not an int on the wire
        (False, int),
        (True, (int, float)),
        (False, float),
        ("3", int),
        (3, str),
        (3, float),  # ints are not silently accepted as floats
        (None, int),
        ([1], dict),
        ({"k": 1}, list),
        (b"x", str),
        (1.0, int),
    ],
)
def test_require_rejects_wrong_types(value, kind):
    with pytest.raises(ProtocolViolation, match="'field'"):
        require({"field": value}, "field", kind)


def test_require_rejects_a_missing_key():
    with pytest.raises(ProtocolViolation, match="'missing'"):
        require({"other": 1}, "missing", int)
    # an explicit None is not a value either, unless NoneType is asked for
    with pytest.raises(ProtocolViolation):
        require({"k": None}, "k", str)
    assert require({"k": None}, "k", (str, type(None))) is None
