"""The read-ahead buffer of a direct connection (peerd/transport/connection.py, ``ReadAhead``): the transport receives
straight into it, reads take from its front; compaction and growth must keep every byte, in order."""

import random

import pytest

from peerd.transport.connection import ReadAhead

pytestmark = pytest.mark.timeout(60)


def _receive(buf: ReadAhead, data: bytes) -> int:
    """What a transport does: ask for space, fill part of it, commit; returns the bytes received."""
    space = buf.space()
    n = min(len(space), len(data))
    space[:n] = data[:n]
    buf.commit(n)
    return n


def test_bytes_come_out_in_order_through_compaction_and_growth():
    rng = random.Random(7)
    stream = rng.randbytes(6_000_000)
    buf = ReadAhead(capacity=100_000)
    received = taken = 0
    out = bytearray()
    compacted = grown = 0
    while taken < len(stream):
        if received < len(stream) and rng.random() < 0.6:
            data_before, start_before = buf.data, buf.start
            received += _receive(buf, stream[received:received + rng.randrange(1, 300_000)])
            if buf.data is not data_before:
                grown += 1
            elif start_before and buf.start == 0 and len(buf):
                compacted += 1
        if len(buf):
            if rng.random() < 0.2:
                target = bytearray(len(buf) + rng.randrange(0, 1000))
                n = buf.take_into(target)
                out += target[:n]
            else:
                out += buf.take(rng.randrange(1, 200_000))
        taken = len(out)
        assert taken <= received
    assert bytes(out) == stream
    assert compacted > 0 and grown > 0  # both ways of making space ran


def test_space_is_at_least_the_minimum_and_a_held_view_survives_growth():
    buf = ReadAhead(capacity=70_000)
    held = buf.space()  # a transport may still hold the view it was given
    held[:60_000] = b"x" * 60_000
    buf.commit(60_000)
    assert buf.take(10) == b"x" * 10  # 59,990 unread do not fit before their place: a new array
    space = buf.space()
    assert len(space) >= 64 * 1024
    assert buf.data is not held.obj
    assert buf.take(60_000) == b"x" * 59_990


def test_put_back_goes_in_front_of_the_unread_bytes():
    buf = ReadAhead(capacity=1000)
    _receive(buf, b"later")
    buf.put_back(memoryview(b"first-"))
    assert len(buf) == 11
    assert buf.take(100) == b"first-later"
    assert len(buf) == 0 and buf.start == buf.end == 0
