"""Warm connections on the direct data plane (peerd/transport/mux.py via DirectStreams(multiplex=True)): one
authenticated TCP connection per peer pair carries every stream of every round, and a dropped one is dialled again.

Discovery and the inner (fallback) streams are an in-process Hub; the direct path is real TCP on 127.0.0.1.
"""

import asyncio
import types

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from peerd.identity.signing import Signer
from peerd.transport.direct import DirectStreams
from peerd.transport.inprocess import Hub
from peerd.transport.records import SignedDiscovery
from protocols.allreduce import AllReduceConfig, ButterflyAllReduce
from protocols.matchmaking import Group, MatchmakingConfig, Matchmaker
from protocols.rpc import Service, call

pytestmark = pytest.mark.timeout(60)

ROUNDS = 5


class _Echo(Service):
    name = "echo"

    async def rpc_echo(self, request):
        return {}, bytes(await request.payload(1 << 20))[::-1]


async def _peers(hub: Hub, n: int):
    out = []
    for _ in range(n):
        signer = Signer(Ed25519PrivateKey.generate())
        inner = hub.transport(signer.peer_id)
        discovery = SignedDiscovery(inner.discovery, signer)
        streams = DirectStreams(inner.streams, discovery, signer, "127.0.0.1", multiplex=True)
        await streams.start()
        transport = types.SimpleNamespace(discovery=discovery, streams=streams)
        mm = Matchmaker(transport, "run", MatchmakingConfig(5.0, 2.0, 0.05))
        ar = ButterflyAllReduce(transport, "run", AllReduceConfig("none", 5.0, 10.0, chunk_numel=4096))
        await mm.start()
        await ar.start()
        out.append((streams, mm, ar))
    return out


def test_five_rounds_between_three_peers_use_one_connection_per_pair_and_a_dropped_one_is_redialled():
    async def main():
        hub = Hub()
        peers = await _peers(hub, 3)
        try:
            xs = [torch.randn(3 * 3 * 4096 + 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
            expected = sum(xs) / 3
            for r in range(ROUNDS):
                members = tuple(sorted(s.peer_id for s, _, _ in peers))  # as sealed by a matchmaking
                group = Group(f"round{r}", f"r{r}", members[0], members, {m: {} for m in members})
                groups = [group] * 3
                out = await asyncio.gather(*[ar.run(g, x, 1.0) for (_, _, ar), g, x in zip(peers, groups, xs)])
                assert all(torch.equal(o.averaged, out[0].averaged) for o in out)
                assert float((out[0].averaged - expected).abs().max()) < 1e-5
            dials = sum(s.stats["tcp_dials"] for s, _, _ in peers)
            opens = sum(s.stats["direct_opens"] for s, _, _ in peers)
            fallbacks = sum(s.stats["fallback_opens"] for s, _, _ in peers)
            print(f"FIGURE warm connections: {ROUNDS} rounds, 3 peers: {dials} TCP connections dialled for {opens} "
                  f"direct streams ({fallbacks} via the fallback)")
            assert dials <= 3  # one per pair, whoever dialled it
            assert fallbacks == 0 and opens >= ROUNDS * 6
            # drop every connection of the first peer: the next streams dial again and succeed
            first = peers[0][0]
            for session in list(first._mux_all):
                session.conn.abort()
            await asyncio.sleep(0.2)
            payload = b"abc" * 1000
            echo = _Echo()
            await echo.start(peers[1][0])
            reply = await call(first, peers[1][0].peer_id, "echo", "echo", {}, payload, timeout_s=10.0,
                               max_reply_bytes=len(payload))
            assert bytes(reply.payload) == payload[::-1]
            assert sum(s.stats["tcp_dials"] for s, _, _ in peers) == dials + 1
            assert first.stats["fallback_opens"] == 0
        finally:
            for streams, _, _ in peers:
                await streams.stop()

    asyncio.run(main())


def test_a_peers_connections_are_paced_at_the_rate_asked_also_when_dialled_later_and_unpaced_again():
    import socket
    import sys

    from peerd.transport.connection import SO_MAX_PACING_RATE, UNPACED_BYTES_PER_S

    async def main():
        hub = Hub()
        peers = await _peers(hub, 2)
        a, b = peers[0][0], peers[1][0]
        echo = _Echo()
        await echo.start(b)
        try:
            linux = sys.platform.startswith("linux")
            # no connection yet: the pace is kept for the one opened next
            assert a.pace(b.peer_id, 1_250_000.7) is linux
            reply = await call(a, b.peer_id, "echo", "echo", {}, b"abc", timeout_s=10.0, max_reply_bytes=3)
            assert bytes(reply.payload) == b"cba"
            sock = a._mux[b.peer_id].conn.get_extra_info("socket")
            if linux:
                assert sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == 1_250_000
                # what reached b on the one connection to it (the handshake and the call: several segments)
                (key, counters), = a.send_counters(b.peer_id).items()
                assert counters.segments_delivered > 1 and counters.segment_bytes > 0 and counters.path_limited_s >= 0
                assert key == id(a._mux[b.peer_id]) and a.send_counters("nobody") == {}
                assert a.pace(b.peer_id, 2_500_000)  # the open connection is paced anew
                assert sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == 2_500_000
                assert a.pace(b.peer_id, None)
                assert sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == UNPACED_BYTES_PER_S
                # dropped and dialled again while paced: the new connection is paced too
                assert a.pace(b.peer_id, 1_000_000)
                first = a._mux[b.peer_id]
                first.close()
                await first.closed_event.wait()
                reply = await call(a, b.peer_id, "echo", "echo", {}, b"def", timeout_s=10.0, max_reply_bytes=3)
                assert bytes(reply.payload) == b"fed"
                assert a._mux[b.peer_id] is not first
                assert list(a.send_counters(b.peer_id)) == [id(a._mux[b.peer_id])]  # the closed one is not counted
                again = a._mux[b.peer_id].conn.get_extra_info("socket")
                assert again.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == 1_000_000
                assert a.pace(b.peer_id, None)
                assert again.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == UNPACED_BYTES_PER_S
            reply = await call(a, b.peer_id, "echo", "echo", {}, b"xyz", timeout_s=10.0, max_reply_bytes=3)
            assert bytes(reply.payload) == b"zyx"  # the paced and unpaced connection still carries streams
        finally:
            for streams, _, _ in peers:
                await streams.stop()

    asyncio.run(main())


def test_streams_over_one_connection_are_independent_and_flow_controlled():
    async def main():
        hub = Hub()
        peers = await _peers(hub, 2)
        a, b = peers[0][0], peers[1][0]
        received = {}

        async def sink(peer, reader, writer):
            size = int.from_bytes(await reader.readexactly(8), "big")
            received[size] = await reader.readexactly(size)
            writer.write(b"ok")
            await writer.drain()

        await b.add_handler("sink", sink)
        try:
            big, small = 20 << 20, 1000  # the big stream exceeds the per-stream window several times over

            async def send(size):
                reader, writer = await a.open(b.peer_id, "sink")
                writer.write(size.to_bytes(8, "big") + bytes(range(256)) * (size // 256) + bytes(size % 256))
                await writer.drain()
                assert await reader.readexactly(2) == b"ok"
                writer.close()

            await asyncio.wait_for(asyncio.gather(send(big), send(small)), 30.0)
            assert len(received[big]) == big and received[big][:256] == bytes(range(256))
            assert len(received[small]) == small
            assert a.stats["tcp_dials"] + b.stats["tcp_dials"] == 1
            # a name the other side does not serve resets that stream only
            reader, writer = await a.open(b.peer_id, "nothing-here")
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await asyncio.wait_for(reader.readexactly(1), 5.0)
            await asyncio.wait_for(send(small), 10.0)
        finally:
            for streams, _, _ in peers:
                await streams.stop()

    asyncio.run(main())


def test_a_frames_small_writes_share_one_mux_frame_and_its_payload_arrives_whole():
    """The prefix and header of an RPC frame go out as one mux frame, a 512 KiB payload (one all-reduce chunk) as
    another, and the reader gets that payload as the very buffer that arrived (no pieces joined)."""
    from peerd.transport import mux
    from protocols.wire import write_frame

    async def main():
        hub = Hub()
        peers = await _peers(hub, 2)
        a, b = peers[0][0], peers[1][0]
        frames, got = [], {}
        dispatch = mux.MuxSession._dispatch

        def counting(session, stream_id, kind, payload):
            if kind == mux.DATA:
                frames.append((session.peer, len(payload), payload))
            return dispatch(session, stream_id, kind, payload)

        async def sink(peer, reader, writer):
            prefix = await reader.readexactly(8)
            header = await reader.readexactly(int.from_bytes(prefix[:4], "big"))
            got["payload"] = await reader.readexactly(int.from_bytes(prefix[4:], "big"))
            got["header"] = header
            writer.write(b"ok")
            await writer.drain()

        await b.add_handler("sink", sink)
        mux.MuxSession._dispatch = counting
        try:
            payload = bytes(range(256)) * (2048 + 1)  # 512 KiB + 256 bytes: more than the old 256 KiB frame
            reader, writer = await a.open(b.peer_id, "sink")
            await write_frame(writer, {"k": 1}, payload)
            assert await asyncio.wait_for(reader.readexactly(2), 10.0) == b"ok"
            writer.close()
        finally:
            mux.MuxSession._dispatch = dispatch
            for streams, _, _ in peers:
                await streams.stop()
        to_b = [(size, data) for peer, size, data in frames if peer == a.peer_id]
        assert [size for size, _ in to_b] == [8 + len(got["header"]), len(payload)]
        assert got["payload"] == payload and got["payload"] is to_b[1][1]

    asyncio.run(main())


def test_a_write_after_tls_found_a_record_altered_raises_stream_corrupted_not_a_plain_reset():
    """The reducer bans a sender whose stream broke (a peer's fault) but not one whose bytes were altered on the path;
    a write that notices the loss first must say which it was (seen on a 16-core machine: the mux's window update
    hit the lost connection before its reader did, and a flipped byte got the honest sender banned)."""
    import ssl

    from peerd.transport.connection import Connection
    from protocols.wire import StreamCorrupted

    written = []
    closing = [False]
    no_extra = lambda name, default=None: default  # noqa: E731 - no socket: nothing to tune
    transport = types.SimpleNamespace(write=written.append, is_closing=lambda: closing[0], get_extra_info=no_extra)
    conn = Connection()
    conn.connection_made(transport)
    conn.write(b"before")
    closing[0] = True  # TLS failed: the transport closes, connection_lost follows
    conn.write(b"dropped")  # nothing raised yet: the loss and its cause come with connection_lost
    conn.connection_lost(ssl.SSLError(1, "[SSL: DECRYPTION_FAILED_OR_BAD_RECORD_MAC] decryption failed"))
    with pytest.raises(StreamCorrupted):
        conn.write(b"after")
    assert written == [b"before"]
    plain = Connection()
    plain.connection_made(types.SimpleNamespace(write=written.append, is_closing=lambda: False,
                                                get_extra_info=no_extra))
    plain.connection_lost(ConnectionResetError("peer went away"))
    with pytest.raises(ConnectionResetError) as reset:
        plain.write(b"x")
    assert not isinstance(reset.value, StreamCorrupted)
