"""Chunked messages of protocols.rpc on a byte stream: layout, 64-bit totals, every size checked before reading."""

import asyncio
import struct

import msgpack
import pytest

from peerd.transport.inprocess import Hub
from protocols.rpc import ProtocolViolation, Unreachable, call, read_message, send_message

pytestmark = pytest.mark.timeout(30)


class _Sink:
    def __init__(self):
        self.data = bytearray()

    def write(self, data):
        self.data += bytes(data)

    async def drain(self):
        pass

    def close(self):
        pass


class _Reader:
    """A stream holding ``data`` that counts what was consumed."""

    def __init__(self, data):
        self.inner = asyncio.StreamReader()
        self.inner.feed_data(bytes(data))
        self.inner.feed_eof()
        self.n = 0

    async def readexactly(self, n):
        try:
            data = await self.inner.readexactly(n)
        except asyncio.IncompleteReadError as e:
            self.n += len(e.partial)
            raise
        self.n += n
        return data


def frame(header, payload=b""):
    h = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">II", len(h), len(payload)) + h + payload


def frames_of(data):
    out, i = [], 0
    while i < len(data):
        hl, pl = struct.unpack_from(">II", data, i)
        out.append((msgpack.unpackb(data[i + 8:i + 8 + hl]), pl))
        i += 8 + hl + pl
    return out


def run(coro):
    return asyncio.run(coro)


async def _read(data, max_bytes, readers=None):
    reader = _Reader(data)
    if readers is not None:
        readers.append(reader)
    return await read_message(reader, max_bytes)


def test_a_small_message_is_one_plain_frame_and_a_large_one_is_chunked():
    async def main():
        small, large = _Sink(), _Sink()
        await send_message(small, {"a": 1}, b"x" * 100, chunk_bytes=100)
        payload = bytes(range(256)) * 40  # 10240 bytes
        written = await send_message(large, {"a": 1}, [payload[:5000], memoryview(payload)[5000:]], chunk_bytes=1000)
        return small.data, large.data, written, payload

    small, large, written, payload = run(main())
    assert small == frame({"a": 1}, b"x" * 100)
    assert frames_of(large) == [({"a": 1, "_total": 10240}, 1000)] + [({}, 1000)] * 9 + [({}, 240)]
    assert written == len(large)
    message = run(_read(large, 10240))
    assert message.header == {"a": 1} and bytes(message.payload) == payload and message.nbytes == len(large)


def test_a_total_above_the_limit_is_refused_on_the_head_before_any_payload_byte():
    data = frame({"_total": 2**40}, b"x" * 10) + b"y" * 100
    readers = []
    with pytest.raises(ProtocolViolation, match="exceeds the limit"):
        run(_read(data, 1 << 20, readers))
    assert readers[0].n == len(frame({"_total": 2**40}))  # prefix and header only


@pytest.mark.parametrize("data", [
    frame({"_total": True}, b"x"),  # not an int
    frame({"_total": -5}, b"x"),
    frame({"_total": 10}, b""),  # an empty first chunk
    frame({"_total": 10}, b"x" * 10),  # a "chunked" message that is one frame
    frame({"_total": 10}, b"x" * 11),  # a first chunk beyond the total
    frame({"_total": 10}, b"x" * 5) + frame({"more": 1}, b"x" * 5),  # a continuation frame with a header
    frame({"_total": 10}, b"x" * 5) + frame({}, b"x" * 6),  # a chunk beyond what remains
    frame({"_total": 10}, b"x" * 5) + frame({}, b""),  # an empty chunk
    frame({"_total": 10}, b"x" * 5) + frame({}, b"x" * 5)[:-2],  # the stream ends mid-chunk
    frame({"_total": 10}, b"x" * 5),  # the stream ends between chunks
])
def test_malformed_chunking_is_a_violation(data):
    with pytest.raises(ProtocolViolation):
        run(_read(data, 100))


def test_a_stream_that_ends_before_a_message_means_the_peer_is_gone():
    with pytest.raises(Unreachable):
        run(_read(b"", 100))
    with pytest.raises(ProtocolViolation):
        run(_read(frame({})[:3], 100))


@pytest.mark.parametrize("header", [{"_total": 1}, {"status": "ok"}, {"code": 1}, {"reason": ""}, {"_x": 0}])
def test_reserved_keys_are_refused_to_callers(header):
    async def main():
        hub = Hub()
        await call(hub.transport("a").streams, "b", "s", "m", header, timeout_s=1)

    with pytest.raises(ValueError, match="reserved"):
        run(main())
