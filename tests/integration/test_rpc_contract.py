"""The RPC contract (protocols.rpc), run on the in-process transport and on real p2pd streams (hivemind backend).

Network: the hivemind variant starts DHT nodes and p2pd on 127.0.0.1 only; run the module inside a loopback-only
namespace (``unshare -n``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
import torch

from peerd.transport.inprocess import Hub
from protocols.rpc import ProtocolViolation, Refused, RpcTimeout, Service, Unreachable, call, open_stream
from protocols.state_transfer import StateServer, StateSnapshot, download_state
from tests.streams import CountingReader

pytestmark = pytest.mark.timeout(180)

SMALL_CHUNK = 4096


class _CountingStreams:
    def __init__(self, inner):
        self.inner, self.readers = inner, []

    @property
    def peer_id(self):
        return self.inner.peer_id

    async def add_handler(self, name, handler):
        await self.inner.add_handler(name, handler)

    async def remove_handler(self, name):
        await self.inner.remove_handler(name)

    async def open(self, peer_id, name):
        reader, writer = await self.inner.open(peer_id, name)
        self.readers.append(CountingReader(reader))
        return self.readers[-1], writer


class Echo(Service):
    """A test service: echo (call), reversed echo of every message (stream), a large reply, failures, a stall."""

    name = "t"
    chunk_bytes = SMALL_CHUNK

    def __init__(self):
        self.seen_violations = []

    async def rpc_echo(self, request):
        payload = await request.payload(1 << 24)
        return {"n": request.size, "header": request.header}, payload

    async def rpc_reverse(self, request):
        first = await request.payload(1 << 24)
        await request.stream.send({"i": request.header["i"]}, bytes(first)[::-1])
        while (message := await request.stream.recv(1 << 24, timeout_s=30)) is not None:
            await request.stream.send({"i": message.header["i"]}, bytes(message.payload)[::-1])

    async def rpc_big(self, request):
        return {}, bytes(4 << 20)

    async def rpc_fail(self, request):
        raise RuntimeError("handler bug")

    async def rpc_busy(self, request):
        raise Refused("try later", "busy")

    async def rpc_stall(self, request):
        await asyncio.sleep(60)

    async def rpc_drip(self, request):
        """A stream that sends one message, then nothing (until the peer goes away)."""
        await request.stream.send({"i": 0}, b"x" * 100)
        await asyncio.sleep(60)

    def on_bad_request(self, peer, method, error):
        self.seen_violations.append((peer, method, type(error).__name__))


@contextlib.asynccontextmanager
async def _inprocess(n):
    hub = Hub()
    transports = [hub.transport(f"peer{i}") for i in range(n)]

    async def kill(i):
        hub.disconnect(transports[i].streams.peer_id)

    yield transports, kill


@contextlib.asynccontextmanager
async def _hivemind(n):
    from peerd.transport.hivemind_backend import HivemindTransport

    first = await HivemindTransport.create(nat_port_map=False)
    transports = [first]
    dead = set()
    try:
        for _ in range(n - 1):
            transports.append(await HivemindTransport.create(initial_peers=first.visible_maddrs(), nat_port_map=False))

        async def kill(i):
            dead.add(i)
            await transports[i].shutdown()

        yield transports, kill
    finally:
        for i, t in enumerate(transports):
            if i not in dead:
                await t.shutdown()


@pytest.fixture(params=["inprocess", "hivemind"])
def peers(request):
    """``peers(n)``: an async context manager yielding ``(transports, kill)`` for n peers of one transport kind."""
    return _inprocess if request.param == "inprocess" else _hivemind


def run(coro):
    return asyncio.run(coro)


def test_call_round_trip_single_and_multi_chunk(peers):
    async def main():
        async with peers(2) as (ts, _):
            await Echo().start(ts[1])
            server = ts[1].streams.peer_id
            for size in (0, 100, 5 * SMALL_CHUNK + 17):  # one frame; several chunks each way
                payload = os.urandom(size)
                reply = await call(ts[0].streams, server, "t", "echo", {"k": [1, "a"]}, payload,
                                   timeout_s=30, max_reply_bytes=1 << 20, chunk_bytes=SMALL_CHUNK)
                assert reply.header == {"n": size, "header": {"k": [1, "a"]}}
                assert bytes(reply.payload) == payload
                assert reply.bytes_sent >= size and reply.nbytes >= size

    run(main())


def test_stream_with_multi_chunk_messages_both_ways(peers):
    async def main():
        async with peers(2) as (ts, _):
            await Echo().start(ts[1])
            messages = [os.urandom(3 * SMALL_CHUNK + i) for i in range(4)]
            stream = await open_stream(ts[0].streams, ts[1].streams.peer_id, "t", "reverse", {"i": 0}, messages[0],
                                       timeout_s=30, chunk_bytes=SMALL_CHUNK)
            async with stream:
                for i, m in enumerate(messages[1:], 1):
                    await stream.send({"i": i}, m)
                await stream.end()
                got = [await stream.recv(1 << 20, timeout_s=30) for _ in messages]
                assert await stream.recv(1 << 20, timeout_s=30) is None  # the handler ended its side
            assert [m.header["i"] for m in got] == [0, 1, 2, 3]
            assert [bytes(m.payload) for m in got] == [m[::-1] for m in messages]
            assert stream.bytes_sent > sum(map(len, messages)) and stream.bytes_received > sum(map(len, messages))

    run(main())


def test_timeout(peers):
    async def main():
        async with peers(2) as (ts, _):
            await Echo().start(ts[1])
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(RpcTimeout):
                await call(ts[0].streams, ts[1].streams.peer_id, "t", "stall", timeout_s=0.5)
            return loop.time() - started

    assert run(main()) < 3.0


def test_unreachable_peer(peers):
    async def main():
        async with peers(3) as (ts, kill):
            await Echo().start(ts[1])
            gone = ts[2].streams.peer_id
            await kill(2)
            with pytest.raises(Unreachable):
                await call(ts[0].streams, gone, "t", "echo", timeout_s=30)
            with pytest.raises(Unreachable):  # a live peer that does not serve the method
                await call(ts[0].streams, ts[1].streams.peer_id, "t", "nothing", timeout_s=30)

    run(main())


def test_oversized_reply_is_refused_on_its_header_before_any_payload_byte(peers):
    async def main():
        async with peers(2) as (ts, _):
            await Echo().start(ts[1])
            counting = _CountingStreams(ts[0].streams)
            with pytest.raises(ProtocolViolation, match="exceeds the limit"):
                await call(counting, ts[1].streams.peer_id, "t", "big", timeout_s=30, max_reply_bytes=1000)
            return counting.readers[0].n

    consumed = run(main())
    assert 0 < consumed < 64  # the 8-byte prefix and the small header of a 4 MiB chunked reply, nothing more


def test_handler_errors_become_typed_refusals(peers):
    async def main():
        async with peers(2) as (ts, _):
            await Echo().start(ts[1])
            server = ts[1].streams.peer_id
            with pytest.raises(Refused) as internal:
                await call(ts[0].streams, server, "t", "fail", timeout_s=30)
            with pytest.raises(Refused) as busy:
                await call(ts[0].streams, server, "t", "busy", timeout_s=30)
            return internal.value, busy.value

    internal, busy = run(main())
    assert internal.code == "internal" and "handler bug" in internal.reason
    assert busy.code == "busy" and busy.reason == "try later"


def test_peer_gone_mid_stream_raises_promptly(peers):
    async def main():
        async with peers(2) as (ts, kill):
            await Echo().start(ts[1])
            stream = await open_stream(ts[0].streams, ts[1].streams.peer_id, "t", "drip", timeout_s=30)
            async with stream:
                first = await stream.recv(1000, timeout_s=30)
                assert first.header == {"i": 0}
                loop = asyncio.get_running_loop()
                started = loop.time()
                await kill(1)
                with pytest.raises((Unreachable, ProtocolViolation)):
                    await stream.recv(1000, timeout_s=30)
                return loop.time() - started

    assert run(main()) < 10.0


def test_garbage_request_is_a_violation_on_the_reading_side(peers):
    async def main():
        async with peers(2) as (ts, _):
            service = Echo()
            await service.start(ts[1])
            reader, writer = await ts[0].streams.open(ts[1].streams.peer_id, "t.echo")
            writer.write(b"\x00\x00\x00\x10\x00\x00\x00\x00" + b"\xc1" * 16)  # a 16-byte header that is not msgpack
            await writer.drain()
            refusal = await asyncio.wait_for(reader.readexactly(8), 30)
            writer.close()
            return service.seen_violations, refusal

    violations, refusal = run(main())
    assert [(method, kind) for _, method, kind in violations] == [("echo", "ProtocolViolation")]
    assert len(refusal) == 8


def test_state_larger_than_one_frame_arrives_bit_identical(peers):
    theta = torch.randn(50_000, generator=torch.Generator().manual_seed(1))
    momentum = torch.randn(50_000, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    snapshot = StateSnapshot.from_tensors({"theta": theta, "momentum": momentum}, {"outer_round": 7})
    assert len(snapshot.payload) > 20 * SMALL_CHUNK

    async def main():
        async with peers(2) as (ts, _):
            await StateServer(ts[1], "run", lambda: snapshot, chunk_bytes=SMALL_CHUNK).start()
            got = await download_state(ts[0], "run", ts[1].streams.peer_id, max_bytes=1 << 20, timeout_s=60)
            return got.tensors({"theta": (torch.float32, 50_000), "momentum": (torch.bfloat16, 50_000)}), got

    tensors, got = run(main())
    assert got.metadata == {"outer_round": 7}
    assert bytes(got.payload) == snapshot.payload
    assert torch.equal(tensors["theta"].view(torch.int32), theta.view(torch.int32))
    assert torch.equal(tensors["momentum"].view(torch.int16), momentum.view(torch.int16))
