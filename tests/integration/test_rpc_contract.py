"""The RPC contract (protocols.rpc) and the transport contract (large streams, records with expiration), run on the
in-process transport, on real p2pd streams (hivemind backend) and on real py-libp2p streams (libp2p backend).

Network: the hivemind and libp2p variants start DHT nodes and daemons on 127.0.0.1 only; run the module inside a
loopback-only namespace (``unshare -n``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random

import pytest
import torch

from peerd.transport.inprocess import Hub
from protocols.rpc import ProtocolViolation, Refused, RpcTimeout, Service, Unreachable, call, open_stream
from protocols.state_transfer import StateServer, StateSnapshot, download_state
from tests.streams import CountingReader, StreamsWrapper

pytestmark = pytest.mark.timeout(180)

SMALL_CHUNK = 4096


class _CountingStreams(StreamsWrapper):
    def __init__(self, inner):
        self.inner, self.readers = inner, []

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

    async def rpc_digest(self, request):
        """sha256 of a payload of any size (``header["n"]`` bytes expected), and ``header["back"]`` seeded random
        bytes sent back."""
        payload = await request.payload(request.header["n"], timeout_s=120)
        back = random.Random(7).randbytes(request.header["back"])
        return {"sha": hashlib.sha256(payload).hexdigest()}, back

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


class _Libp2pPool:
    """Real py-libp2p peers shared by every test of this module (each takes seconds to start): they live on one
    event loop for the whole module; a peer a test kills is replaced by a fresh one for the next test, and the
    handlers a test served are removed after it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.transports = []

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    @contextlib.asynccontextmanager
    async def peers(self, n):
        from peerd.transport.libp2p_backend import LibP2PTransport

        while len(self.transports) < n:
            initial = self.transports[0].visible_maddrs() if self.transports else ()
            self.transports.append(await LibP2PTransport.create(initial_peers=initial))
        transports = self.transports[:n]
        dead = []

        async def kill(i):
            dead.append(transports[i])
            await transports[i].shutdown()
            p2p = transports[i].streams.p2p  # nothing left behind: daemon process, its socket, the DHT process
            assert p2p._child.returncode is not None
            assert not os.path.exists(p2p.daemon_listen_maddr["unix"])
            assert not transports[i].dht.is_alive()

        try:
            yield transports, kill
        finally:
            self.transports = [t for t in self.transports if t not in dead]
            for t in self.transports:
                for name in list(t.streams._served):
                    await t.streams.remove_handler(name)

    def close(self):
        for t in self.transports:
            self.run(t.shutdown())
        leftover = asyncio.all_tasks(self.loop)  # handlers of killed peers' streams, stalls of test_timeout
        for task in leftover:
            task.cancel()
        if leftover:  # gather() of nothing looks for a current loop, and there is none when no test used the pool
            self.run(asyncio.gather(*leftover, return_exceptions=True))
        self.loop.close()


@pytest.fixture(scope="module")
def libp2p_pool():
    pool = _Libp2pPool()
    try:
        yield pool
    finally:
        pool.close()


class _Kind:
    """``peers(n)``: an async context manager yielding ``(transports, kill)`` for n peers of one transport kind;
    ``peers.run(coroutine)`` runs a test's body where those peers live."""

    def __init__(self, factory, runner):
        self.factory, self.run = factory, runner

    def __call__(self, n):
        return self.factory(n)


@pytest.fixture(params=["inprocess", "hivemind", "libp2p"])
def peers(request):
    if request.param == "libp2p":
        pool = request.getfixturevalue("libp2p_pool")
        return _Kind(pool.peers, pool.run)
    return _Kind(_inprocess if request.param == "inprocess" else _hivemind, asyncio.run)


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

    peers.run(main())


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

    peers.run(main())


def test_timeout(peers):
    async def main():
        async with peers(2) as (ts, _):
            await Echo().start(ts[1])
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(RpcTimeout):
                await call(ts[0].streams, ts[1].streams.peer_id, "t", "stall", timeout_s=0.5)
            return loop.time() - started

    assert peers.run(main()) < 3.0


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

    peers.run(main())


def test_oversized_reply_is_refused_on_its_header_before_any_payload_byte(peers):
    async def main():
        async with peers(2) as (ts, _):
            await Echo().start(ts[1])
            counting = _CountingStreams(ts[0].streams)
            with pytest.raises(ProtocolViolation, match="exceeds the limit"):
                await call(counting, ts[1].streams.peer_id, "t", "big", timeout_s=30, max_reply_bytes=1000)
            return counting.readers[0].n

    consumed = peers.run(main())
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

    internal, busy = peers.run(main())
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

    assert peers.run(main()) < 10.0


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

    violations, refusal = peers.run(main())
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

    tensors, got = peers.run(main())
    assert got.metadata == {"outer_round": 7}
    assert bytes(got.payload) == snapshot.payload
    assert torch.equal(tensors["theta"].view(torch.int32), theta.view(torch.int32))
    assert torch.equal(tensors["momentum"].view(torch.int16), momentum.view(torch.int16))


@pytest.fixture(params=["hivemind", "libp2p"])
def real_peers(request):
    """``peers`` on the real transports only (the in-process one copies Python objects, no bytes to lose)."""
    if request.param == "libp2p":
        pool = request.getfixturevalue("libp2p_pool")
        return _Kind(pool.peers, pool.run)
    return _Kind(_hivemind, asyncio.run)


def test_large_stream_arrives_intact(real_peers):
    """64 MiB + 5 bytes to a handler in the default (64 MiB) chunks, i.e. two frames; 1 MiB + 3 bytes back."""
    peers = real_peers
    up = random.Random(3).randbytes((64 << 20) + 5)
    back = (1 << 20) + 3

    async def main():
        async with peers(2) as (ts, _):
            await Echo().start(ts[1])
            return await call(ts[0].streams, ts[1].streams.peer_id, "t", "digest", {"n": len(up), "back": back},
                              up, timeout_s=120, max_reply_bytes=back)

    reply = peers.run(main())
    assert reply.header["sha"] == hashlib.sha256(up).hexdigest()
    assert len(reply.payload) == back
    assert hashlib.sha256(reply.payload).digest() == hashlib.sha256(random.Random(7).randbytes(back)).digest()


def test_records_expire(peers):
    """A record stored by one peer is read by another until its expiration time, then no longer."""

    async def main():
        async with peers(2) as (ts, _):
            if not hasattr(ts[0], "discovery"):
                pytest.fail("every transport kind has a discovery")
            now = ts[0].discovery.time()
            assert await ts[0].discovery.store("contract-key", "a", b"soon", now + 3.0)
            assert await ts[0].discovery.store("contract-key", "b", b"later", now + 60.0)
            seen = await ts[1].discovery.get("contract-key")
            await asyncio.sleep(max(0.0, now + 3.5 - ts[0].discovery.time()))
            return seen, await ts[1].discovery.get("contract-key")

    before, after = peers.run(main())
    assert {k: r.value for k, r in before.items()} == {"a": b"soon", "b": b"later"}
    assert {k: r.value for k, r in after.items()} == {"b": b"later"}
