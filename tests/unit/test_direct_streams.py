"""The direct TCP data plane (peerd/transport/direct.py): streams go over TLS 1.3 between the processes' event
loops instead of p2pd, and fall back to the inner streams whenever that is impossible. (Attacks on the channel
itself: tests/unit/test_direct_tls.py.)

Discovery and the inner streams are an in-process Hub (discovery through SignedDiscovery, as in the daemon); the
direct path is real TCP on 127.0.0.1. Every test counts which path a stream took.
"""

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import struct

import msgpack
import pytest
import uvloop
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import peerd.transport.direct as direct
from peerd.identity.signing import Signer, owner_subkey
from peerd.transport.connection import Connection, open_connection
from peerd.transport.direct import DATAPLANE_KEY, DirectStreams, HandshakeRefused, client_handshake
from peerd.transport.tls import PeerTLS
from peerd.transport.inprocess import Hub
from peerd.transport.pacing import pace
from peerd.transport.records import SignedDiscovery
from protocols.interfaces import PeerStreams
from protocols.wire import read_frame, write_frame
from tests.streams import StreamsWrapper

pytestmark = pytest.mark.timeout(60)

BIG = 25_000_000  # bytes


class CountingStreams(StreamsWrapper):
    """Inner streams that count the streams opened through them (the p2pd path, as the direct layer sees it)."""

    def __init__(self, inner):
        self.inner = inner
        self.opens = 0

    async def open(self, peer_id, name):
        self.opens += 1
        return await self.inner.open(peer_id, name)


def new_signer() -> Signer:
    return Signer(Ed25519PrivateKey.generate())


def make_peer(hub: Hub, signer: Signer, **kwargs) -> DirectStreams:
    transport = hub.transport(signer.peer_id)
    return DirectStreams(CountingStreams(transport.streams), SignedDiscovery(transport.discovery, signer), signer,
                         "127.0.0.1", **kwargs)


@contextlib.asynccontextmanager
async def swarm(n: int, start: bool = True):
    """``n`` DirectStreams peers on one hub, started (listening, address published); always stopped."""
    hub = Hub()
    peers = [make_peer(hub, new_signer()) for _ in range(n)]
    try:
        if start:
            for p in peers:
                await p.start()
        yield hub, peers
    finally:
        for p in peers:
            await p.stop()


async def serve_echo(streams, name: str = "echo") -> list:
    """Serve frames back to their sender; returns the list of remote PeerIDs the handler saw."""
    seen = []

    async def echo(peer, reader, writer):
        seen.append(peer)
        header, payload, _ = await read_frame(reader, 2 * BIG)
        await write_frame(writer, {"echo": header, "sha": hashlib.sha256(payload).hexdigest()}, payload)

    await streams.add_handler(name, echo)
    return seen


async def round_trip(streams, peer: str, payload: bytes, name: str = "echo") -> tuple[dict, bytes]:
    reader, writer = await streams.open(peer, name)
    try:
        await write_frame(writer, {"n": len(payload)}, payload)
        header, answer, _ = await asyncio.wait_for(read_frame(reader, 2 * BIG), 30)
    finally:
        writer.close()
    return header, answer


async def closed_by_server(sock_reader: asyncio.StreamReader, timeout_s: float = 10.0) -> bool:
    """True once the server has closed the connection (EOF or reset)."""
    try:
        while await asyncio.wait_for(sock_reader.read(65536), timeout_s):
            pass
    except (ConnectionError, OSError):
        pass
    return True


async def eventually(condition, timeout_s: float = 5.0) -> bool:
    """Wait until ``condition()`` holds (the server counts a refusal just after the client saw it)."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


# ----------------------------------------------------------------------------------------------- the direct path


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_frames_go_direct_and_the_handler_sees_the_authenticated_peer(loop):
    async def main():
        async with swarm(2) as (_, (a, b)):
            assert isinstance(a, PeerStreams)
            seen = await serve_echo(b)
            for size in (0, 5, 100_000):
                header, answer = await round_trip(a, b.peer_id, os.urandom(size))
                assert header["echo"] == {"n": size} and len(answer) == size
            assert seen == [a.peer_id] * 3
            assert a.stats["direct_opens"] == 3 and a.stats["fallback_opens"] == 0
            assert a.inner.opens == 0 and b.stats["served_direct"] == 3 and b.stats["refused"] == 0

    (uvloop.run if loop == "uvloop" else asyncio.run)(main())


def test_a_25_mb_payload_round_trips_intact():
    async def main():
        async with swarm(2) as (hub, (a, b)):
            fixed = make_peer(hub, new_signer(), socket_buffer_bytes=1 << 20)  # fixed kernel buffers, if allowed
            await fixed.start()
            await serve_echo(b)
            await serve_echo(fixed)
            payload = os.urandom(BIG)
            try:
                _, answer = await round_trip(a, fixed.peer_id, payload)
                assert answer == payload and fixed.stats["served_direct"] == 1
            finally:
                await fixed.stop()
            header, answer = await round_trip(a, b.peer_id, payload)
            assert answer == payload and header["sha"] == hashlib.sha256(payload).hexdigest()
            assert a.inner.opens == 0 and a.stats["direct_opens"] == 2

    uvloop.run(main())


def test_mixed_frame_sizes_back_to_back_and_eof_mid_payload():
    """Read-ahead buffering and reads straight into results interleave correctly; EOF mid-payload is an
    IncompleteReadError with what arrived."""

    async def main():
        async with swarm(2) as (_, (a, b)):
            sizes = [0, 7, 70_000, 1, 3_000_000, 65_535, 65_536, 200_000, 12]
            blobs = [os.urandom(n) for n in sizes]
            got, partial = [], []

            async def sink(peer, reader, writer):
                for n in sizes:
                    got.append(await reader.readexactly(n))
                try:
                    await reader.readexactly(1_000_000)
                except asyncio.IncompleteReadError as e:
                    partial.append(e.partial)

            await b.add_handler("sink", sink)
            reader, writer = await a.open(b.peer_id, "sink")
            writer.write(b"".join(blobs) + b"tail")  # one write: the receiver sees arbitrary chunk boundaries
            await writer.drain()
            writer.close()
            for _ in range(100):
                if partial:
                    break
                await asyncio.sleep(0.05)
            assert got == blobs and partial == [b"tail"]

    asyncio.run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_timed_out_large_read_keeps_what_arrived_and_a_closed_stream_refuses_writes(loop):
    async def main():
        async with swarm(2) as (_, (a, b)):
            blob = os.urandom(1_000_000)
            got, errors = [], []

            async def patient(peer, reader, writer):
                with contextlib.suppress(asyncio.TimeoutError):
                    got.append(await asyncio.wait_for(reader.readexactly(len(blob)), 0.3))
                got.append(await reader.readexactly(len(blob)))
                writer.close()
                try:
                    for _ in range(100):
                        writer.write(b"x")
                        await writer.drain()
                        await asyncio.sleep(0.01)
                except ConnectionError as e:
                    errors.append(e)

            await b.add_handler("patient", patient)
            reader, writer = await a.open(b.peer_id, "patient")
            writer.write(blob[:300_000])
            await writer.drain()
            await asyncio.sleep(0.6)  # the first read times out with 300 KB received
            writer.write(blob[300_000:])
            await writer.drain()
            with pytest.raises(asyncio.IncompleteReadError):  # the handler closed its end
                await asyncio.wait_for(reader.readexactly(1), 10)
            assert await eventually(lambda: errors)
            assert got == [blob] and isinstance(errors[0], ConnectionResetError)
            writer.close()

    (uvloop.run if loop == "uvloop" else asyncio.run)(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_pacing_and_passthrough_work_on_top(loop):
    """The daemon stacks pacing (and admission) on DirectStreams: capped reads come in 64 KB chunks, report() and
    unknown attributes reach the inner streams."""

    async def main():
        async with swarm(2) as (_, (a, b)):
            a.inner.marker = "inner attribute"
            await serve_echo(pace(b, upload_bytes_per_s=50e6, download_bytes_per_s=50e6))
            paced = pace(a, upload_bytes_per_s=50e6, download_bytes_per_s=50e6)
            payload = os.urandom(2_000_000)
            _, answer = await round_trip(paced, b.peer_id, payload)
            assert answer == payload and a.stats["direct_opens"] == 1
            assert paced.report()["upload"]["bytes"] >= len(payload) and a.marker == "inner attribute"

    (uvloop.run if loop == "uvloop" else asyncio.run)(main())


# ----------------------------------------------------------------------------------------------- authentication


def test_an_impostor_client_is_refused():
    """A client with another key presenting a certificate for a's PeerID never reaches the handler: refused at the
    hello (the certificate's extension is not signed by a's key)."""

    async def main():
        async with swarm(2) as (_, (a, b)):
            seen = await serve_echo(b)
            impostor = new_signer()
            impostor.peer_id = a.peer_id  # says "I am a", signs with its own key
            conn = await open_connection("127.0.0.1", b.port)
            with pytest.raises(HandshakeRefused) as refused:
                await client_handshake(conn, PeerTLS(impostor), b.peer_id, "echo")
            conn.close()
            assert refused.value.code == "malformed" and "certificate" in str(refused.value)
            assert await eventually(lambda: b.stats["refused"] == 1)
            assert seen == [] and b.stats["served_direct"] == 0
            _, answer = await round_trip(a, b.peer_id, b"still serving")  # the real a gets through
            assert answer == b"still serving" and seen == [a.peer_id]

    asyncio.run(main())


async def serve_raw(handler):
    """A listener on 127.0.0.1 whose connections (:class:`Connection`) go to ``handler(conn)``."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Connection(lambda conn: asyncio.ensure_future(handler(conn))),
                                    "127.0.0.1", 0)


def test_an_impostor_server_is_not_trusted_and_the_stream_falls_back():
    """b's address points at a server that claims b's PeerID without b's key: a's open goes through the inner
    streams instead."""

    async def main():
        async with swarm(2) as (_, (a, b)):
            seen = await serve_echo(b)
            fake = Signer(Ed25519PrivateKey.generate())
            fake.peer_id = b.peer_id  # says "I am b", signs with its own key

            async def impostor(conn):
                with contextlib.suppress(Exception):
                    await direct.server_handshake(conn, PeerTLS(fake), lambda name: True)
                    await conn.read()
                conn.close()

            server = await serve_raw(impostor)
            b.port = server.sockets[0].getsockname()[1]
            await b._publish()  # b's (signed) record now names the impostor's port
            _, answer = await round_trip(a, b.peer_id, b"hello")
            server.close()
            assert answer == b"hello" and seen == [a.peer_id]
            assert a.stats["direct_failed"] == 1 and a.stats["fallback_opens"] == 1 and a.inner.opens == 1

    asyncio.run(main())


def test_a_hello_for_another_peer_is_refused():
    async def main():
        async with swarm(3) as (_, (a, b, c)):
            seen_b, seen_c = await serve_echo(b), await serve_echo(c)
            # directly: c's listener refuses a hello addressed to b
            conn = await open_connection("127.0.0.1", c.port)
            with pytest.raises(HandshakeRefused) as refused:
                await client_handshake(conn, a.tls, b.peer_id, "echo")
            conn.close()
            assert refused.value.code == "wrong_peer" and await eventually(lambda: c.stats["refused"] == 1)
            # through open(): a stale record of b that names c's port (b restarted, c took the port) falls back
            b.port, real_port = c.port, b.port
            await b._publish()
            _, answer = await round_trip(a, b.peer_id, b"x")
            assert answer == b"x" and seen_b == [a.peer_id] and seen_c == []
            assert a.inner.opens == 1 and a.stats["fallback_opens"] == 1
            assert await eventually(lambda: c.stats["refused"] == 2)
            b.port = real_port

    asyncio.run(main())


def test_a_handler_name_the_server_does_not_serve_is_refused():
    async def main():
        async with swarm(2) as (_, (a, b)):
            conn = await open_connection("127.0.0.1", b.port)
            with pytest.raises(HandshakeRefused) as refused:
                await client_handshake(conn, a.tls, b.peer_id, "nothing-here")
            conn.close()
            assert refused.value.code == "not_served"
            with pytest.raises(ConnectionError):  # open() falls back to the inner streams, which refuse too
                await a.open(b.peer_id, "nothing-here")
            assert a.inner.opens == 1

    asyncio.run(main())


def test_forged_address_records_are_ignored():
    """An unsigned record under b's owner subkey (anyone can write the hub) is dropped: no redirection."""

    async def main():
        async with swarm(2, start=False) as (hub, (a, b)):
            await a.start()  # b has no data plane
            await serve_echo(b)
            await hub.transport("attacker").discovery.store(
                DATAPLANE_KEY, owner_subkey(b.peer_id), {"host": "127.0.0.1", "port": a.port}, a.discovery.time() + 60)
            _, answer = await round_trip(a, b.peer_id, b"y")
            assert answer == b"y" and a.inner.opens == 1 and a.stats["direct_failed"] == 0
            assert a.discovery.refused  # the forged record was seen and dropped

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- hostile bytes


def test_garbage_oversized_and_silent_handshakes_are_closed_and_the_server_keeps_serving(monkeypatch, caplog):
    monkeypatch.setattr(direct, "HANDSHAKE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(direct, "MAX_PENDING_HANDSHAKES", 4)

    async def main():
        async with swarm(2) as (_, (a, b)):
            seen = await serve_echo(b)
            hello = msgpack.packb({"v": 2, "to": b.peer_id, "cert": a.tls.certificate})
            plaintext_hello = msgpack.packb({"v": 1, "from": a.peer_id, "to": b.peer_id, "name": "echo",
                                             "nonce": b"n" * 32})  # version 1: no TLS after it
            attacks = [
                os.urandom(200),  # garbage
                struct.pack(">II", 10_000_000, 0),  # a 10 MB header announced
                struct.pack(">II", 3, 0) + b"\x93\x01\x02",  # a header that is not a map
                struct.pack(">II", len(hello), 1_000_000) + hello,  # a hello with a payload
                struct.pack(">II", 2, 0) + b"\xc1\xc1",  # msgpack that does not parse
                struct.pack(">II", len(plaintext_hello), 0) + plaintext_hello,  # the old plaintext handshake
                struct.pack(">II", len(hello), 0) + hello + b"plaintext instead of TLS",
                b"",  # nothing at all: the handshake times out
            ]
            for attack in attacks:
                reader, writer = await asyncio.open_connection("127.0.0.1", b.port)
                writer.write(attack)
                await writer.drain()
                assert await closed_by_server(reader)
                writer.close()
            assert await eventually(lambda: b.stats["refused"] == len(attacks)) and seen == []
            # more silent connections than the cap: the extra ones are closed at once
            conns = [await asyncio.open_connection("127.0.0.1", b.port) for _ in range(6)]
            await asyncio.sleep(0.1)
            closed_at_once = 0
            for reader, _ in conns[4:]:
                closed_at_once += await asyncio.wait_for(closed_by_server(reader), 0.3)
            assert closed_at_once == 2
            for reader, writer in conns:
                assert await closed_by_server(reader)
                writer.close()
            _, answer = await round_trip(a, b.peer_id, b"alive")
            assert answer == b"alive" and seen == [a.peer_id] and a.stats["direct_opens"] == 1

    with caplog.at_level(logging.WARNING, logger="peerd.transport.direct"):
        asyncio.run(main())
    refusals = [r for r in caplog.records if getattr(r, "event", None) == "direct_refused"]
    assert 1 <= len(refusals) <= 8  # logged once per kind of failure, not once per connection


# ----------------------------------------------------------------------------------------------------- fallback


def test_falls_back_when_the_peer_has_no_data_plane(caplog):
    async def main():
        async with swarm(2, start=False) as (_, (a, b)):
            await a.start()
            seen = await serve_echo(b)  # b serves through its inner streams only
            for _ in range(3):
                _, answer = await round_trip(a, b.peer_id, b"via inner")
                assert answer == b"via inner"
            assert seen == [a.peer_id] * 3 and a.inner.opens == 3
            assert a.stats["fallback_opens"] == 3 and a.stats["direct_opens"] == 0

    with caplog.at_level(logging.INFO, logger="peerd.transport.direct"):
        asyncio.run(main())
    assert len([r for r in caplog.records if getattr(r, "event", None) == "direct_fallback"]) == 1  # once per peer


def test_a_peer_not_yet_dialable_is_reached_through_the_inner_streams_without_a_connect_attempt():
    """b listens but publishes its address only once it is found dialable: until then a opens its streams to b
    through the inner streams at once (no TCP connect to wait for), b's own streams to a go direct; once b
    publishes, a goes direct too; a withdrawn address sends a back to the inner streams."""

    async def main():
        hub = Hub()
        a, b = make_peer(hub, new_signer()), make_peer(hub, new_signer(), publish=False)
        try:
            await a.start()
            await b.start()
            seen_b, seen_a = await serve_echo(b), await serve_echo(a)
            _, answer = await round_trip(a, b.peer_id, b"not dialable yet")
            assert answer == b"not dialable yet" and seen_b == [a.peer_id]
            assert a.inner.opens == 1 and a.stats["fallback_opens"] == 1
            assert a.stats["tcp_dials"] == 0 and a.stats["direct_failed"] == 0  # nothing dialled, nothing waited for
            _, answer = await round_trip(b, a.peer_id, b"outgoing is direct")
            assert answer == b"outgoing is direct" and b.stats["direct_opens"] == 1 and b.inner.opens == 0
            await b.set_dialable(True)
            a._looked_up_at = -float("inf")  # read the table again now, not after LOOKUP_RETRY_S
            _, answer = await round_trip(a, b.peer_id, b"now direct")
            assert answer == b"now direct" and a.stats["direct_opens"] == 1 and a.inner.opens == 1
            await b.set_dialable(False)
            a._looked_up_at = -float("inf")
            a._addresses.clear()  # as after ADDRESS_TTL_S
            _, answer = await round_trip(a, b.peer_id, b"withdrawn")
            assert answer == b"withdrawn" and a.inner.opens == 2 and a.stats["direct_opens"] == 1
            assert seen_b == [a.peer_id] * 3 and seen_a == [b.peer_id]
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


def test_a_peer_that_publishes_no_address_is_reached_over_the_connection_it_dialled():
    """With warm connections, b (behind a NAT: no address published) dials a; a's streams to b then use that
    connection instead of p2pd."""

    async def main():
        hub = Hub()
        a = make_peer(hub, new_signer(), multiplex=True)
        b = make_peer(hub, new_signer(), multiplex=True, publish=False)
        try:
            await a.start()
            await b.start()
            seen_b, seen_a = await serve_echo(b), await serve_echo(a)
            _, answer = await round_trip(a, b.peer_id, b"before b dialled")  # no address, no connection: p2pd
            assert answer == b"before b dialled" and a.inner.opens == 1 and a.stats["tcp_dials"] == 0
            _, answer = await round_trip(b, a.peer_id, b"b dials a")
            assert answer == b"b dials a" and b.stats["mux_dialled"] == 1 and b.inner.opens == 0
            _, answer = await round_trip(a, b.peer_id, b"over b's connection")
            assert answer == b"over b's connection" and a.inner.opens == 1 and a.stats["direct_opens"] == 1
            assert a.stats["tcp_dials"] == 0 and a.stats["mux_accepted"] == 1
            assert seen_b == [a.peer_id, a.peer_id] and seen_a == [b.peer_id]
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


def test_falls_back_when_the_peer_port_is_closed():
    async def main():
        async with swarm(2) as (_, (a, b)):
            seen = await serve_echo(b)
            await round_trip(a, b.peer_id, b"direct")
            port = b.port
            await b.stop()  # its record stays in the DHT until it expires; nothing listens any more
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", port)) != 0
            for _ in range(2):
                _, answer = await round_trip(a, b.peer_id, b"fallback")
                assert answer == b"fallback"
            assert seen == [a.peer_id] * 3 and a.inner.opens == 2
            assert a.stats["direct_opens"] == 1 and a.stats["fallback_opens"] == 2
            assert a.stats["direct_failed"] == 1  # the failed address is not retried for UNREACHABLE_RETRY_S

    asyncio.run(main())


def test_the_signer_must_own_the_streams():
    hub = Hub()
    streams = hub.transport(new_signer().peer_id).streams
    with pytest.raises(ValueError):
        DirectStreams(streams, hub.transport("x").discovery, new_signer(), "127.0.0.1")
    s = new_signer()
    with pytest.raises(ValueError):
        DirectStreams(hub.transport(s.peer_id).streams, hub.transport("y").discovery, s, "0.0.0.0")
