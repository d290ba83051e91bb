"""Attacks on the direct data plane's channel (TLS 1.3 bound to PeerIDs: peerd/transport/tls.py, handshake.py).

An on-path relay (real TCP on 127.0.0.1, b's signed address record pointed at it) sees, records, alters, replays and
reflects bytes; every test counts that its attack happened and that nothing altered or unauthenticated reached a
handler.
"""

import asyncio
import contextlib
import datetime
import os
import types

import pytest
import torch
from cryptography import x509
from cryptography.hazmat import asn1
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from peerd.transport.connection import open_connection
from peerd.transport.direct import DirectStreams
from peerd.transport.handshake import HandshakeFailed, HandshakeRefused, client_handshake
from peerd.transport.inprocess import Hub
from peerd.transport.records import SignedDiscovery
from peerd.transport.tls import (EXTENSION_OID, CertificateRejected, PeerTLS, SignedKey, make_certificate,
                                 peer_id_of_certificate)
from protocols.allreduce import AllReduceConfig, AllReduceFailed, ButterflyAllReduce
from protocols.matchmaking import Group
from protocols.wire import StreamEnded, read_frame, write_frame
from tests.unit.test_direct_streams import eventually, new_signer, round_trip, serve_echo, serve_raw, swarm

pytestmark = pytest.mark.timeout(60)


class Relay:
    """An on-path TCP relay to ``127.0.0.1:target_port``. ``flip_at``: flip one bit of the byte at this offset of
    the first connection's client-to-server bytes. ``recorded``: per connection, the bytes each way."""

    def __init__(self, target_port: int, flip_at=None):
        self.target_port = target_port
        self.flip_at = flip_at
        self.flips = 0
        self.recorded: list[dict[str, bytearray]] = []
        self.server = None
        self._tasks: set = set()

    async def start(self) -> "Relay":
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def close(self) -> None:
        self.server.close()
        for task in self._tasks:
            task.cancel()

    async def _relay(self, reader, writer) -> None:
        record = {"up": bytearray(), "down": bytearray()}
        first = not self.recorded
        self.recorded.append(record)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src, dst, direction):
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    seen = len(record[direction])
                    if direction == "up" and first and self.flip_at is not None and \
                            seen <= self.flip_at < seen + len(data):
                        data = bytearray(data)
                        data[self.flip_at - seen] ^= 0x01
                        self.flips += 1
                    record[direction] += data
                    dst.write(bytes(data))
                    await dst.drain()
            dst.close()

        tasks = [asyncio.ensure_future(pipe(reader, up_writer, "up")),
                 asyncio.ensure_future(pipe(up_reader, writer, "down"))]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)


async def through(relay_target, peer: DirectStreams, **kwargs) -> Relay:
    """A relay to ``relay_target``'s port, published as ``peer``'s data plane address (signed by ``peer``)."""
    relay = await Relay(relay_target.port, **kwargs).start()
    real = peer.port
    peer.port = relay.port
    await peer._publish()
    peer.port = real
    return relay


# --------------------------------------------------------------------------------------------------- certificates


def test_a_certificate_names_its_signer_and_a_forged_or_expired_one_is_rejected():
    signer = new_signer()
    der, _ = make_certificate(signer)
    assert peer_id_of_certificate(der) == signer.peer_id
    extension = x509.load_der_x509_certificate(der).extensions.get_extension_for_oid(EXTENSION_OID)
    assert not extension.critical
    signed = asn1.decode_der(SignedKey, extension.value.value)
    assert signed.public_key == b"\x08\x01\x12\x20" + signer.public_key  # libp2p PublicKey protobuf, Ed25519

    forger = new_signer()
    forger.peer_id = signer.peer_id  # claims signer's PeerID, signs with its own key
    with pytest.raises(CertificateRejected, match="does not verify"):
        peer_id_of_certificate(make_certificate(forger)[0])
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=3)
    with pytest.raises(CertificateRejected, match="validity"):
        peer_id_of_certificate(make_certificate(signer, now=past, days=1)[0])
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "x")])
    now = datetime.datetime.now(datetime.timezone.utc)
    plain = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
             .serial_number(1).not_valid_before(now - datetime.timedelta(hours=1))
             .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    with pytest.raises(CertificateRejected, match="extension"):
        peer_id_of_certificate(plain.public_bytes(serialization.Encoding.DER))
    for garbage in (b"", os.urandom(300), b"x" * 10_000, None):
        with pytest.raises(CertificateRejected):
            peer_id_of_certificate(garbage)


# --------------------------------------------------------------------------------------------------- on the path


@pytest.mark.parametrize("multiplex", [False, True])
def test_a_flipped_byte_fails_the_stream_and_nothing_altered_reaches_the_handler(multiplex):
    async def main():
        async with swarm(2) as (_, (a, b)):
            a.multiplex = b.multiplex = multiplex
            completed = []

            async def sink(peer, reader, writer):
                header, payload, _ = await read_frame(reader, 1 << 24)
                completed.append(payload)
                await write_frame(writer, {"ok": True})

            await b.add_handler("sink", sink)
            relay = await through(b, b, flip_at=100_000)  # past the handshake: inside the encrypted stream
            try:
                payload = os.urandom(2_000_000)
                with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                    reader, writer = await a.open(b.peer_id, "sink")
                    await write_frame(writer, {"n": len(payload)}, payload)
                    await asyncio.wait_for(read_frame(reader, 0), 20)
            finally:
                relay.close()
            assert relay.flips == 1 and a.stats["direct_opens"] == 1 and a.inner.opens == 0
            assert completed == []  # the altered record failed TLS's authentication: the connection ended
            assert len(relay.recorded[0]["up"]) > 100_000

    asyncio.run(main())


def test_every_byte_on_the_wire_is_encrypted():
    async def main():
        async with swarm(2) as (_, (a, b)):
            await serve_echo(b)
            relay = await through(b, b)
            marker = b"pseudo-gradient bytes " * 5000
            _, answer = await round_trip(a, b.peer_id, marker)
            relay.close()
            assert answer == marker and a.stats["direct_opens"] == 1
            wire = relay.recorded[0]
            assert len(wire["up"]) > len(marker) and len(wire["down"]) > len(marker)
            for direction in ("up", "down"):
                assert b"pseudo-gradient" not in wire[direction] and b"echo" not in wire[direction]

    asyncio.run(main())


def test_a_replayed_handshake_is_refused():
    """The client's bytes of a whole successful connection, sent again on a new connection, get nothing."""

    async def main():
        async with swarm(2) as (_, (a, b)):
            seen = await serve_echo(b)
            relay = await through(b, b)
            await round_trip(a, b.peer_id, b"once")
            relay.close()
            assert seen == [a.peer_id] and len(relay.recorded) == 1
            reader, writer = await asyncio.open_connection("127.0.0.1", b.port)
            writer.write(bytes(relay.recorded[0]["up"]))
            await writer.drain()
            with contextlib.suppress(ConnectionError):
                while await asyncio.wait_for(reader.read(65536), 10):
                    pass
            writer.close()
            assert await eventually(lambda: b.stats["refused"] == 1)
            assert seen == [a.peer_id] and b.stats["served_direct"] == 1

    asyncio.run(main())


def test_a_reflected_handshake_is_refused():
    """a dials b, but the path leads back to a's own listener: a's listener refuses (wrong peer), and so does it a
    hello rewritten to name a itself (its own certificate); the stream falls back to the inner streams."""

    async def main():
        async with swarm(2) as (_, (a, b)):
            seen_a, seen_b = await serve_echo(a), await serve_echo(b)
            relay = await through(a, b)  # b's address leads to a
            _, answer = await round_trip(a, b.peer_id, b"reflected")
            relay.close()
            assert len(relay.recorded) == 1 and answer == b"reflected"
            assert seen_a == [] and seen_b == [a.peer_id] and a.inner.opens == 1 and a.stats["direct_failed"] == 1
            conn = await open_connection("127.0.0.1", a.port)
            with pytest.raises(HandshakeRefused, match="reflected"):
                await client_handshake(conn, a.tls, a.peer_id, "echo")
            conn.close()
            assert await eventually(lambda: a.stats["refused"] == 2) and seen_a == []

    asyncio.run(main())


def test_an_impersonator_with_a_copied_certificate_gets_nothing():
    """Someone who copied a's certificate (it travels in the clear) but holds another key: its hello is accepted,
    its TLS handshake is not (the server pins the hello's certificate and the client cannot prove its key)."""

    async def main():
        async with swarm(2) as (_, (a, b)):
            seen = await serve_echo(b)
            impostor = PeerTLS(new_signer())
            conn = await open_connection("127.0.0.1", b.port)
            try:
                await write_frame(conn, {"v": 2, "to": b.peer_id, "cert": a.tls.certificate})
                reply, _, _ = await read_frame(conn, 0)
                assert reply == {"v": 2}
                with pytest.raises((HandshakeFailed, ConnectionError, StreamEnded, OSError)):  # TLS 1.3: the alert may come after
                    await conn.start_tls(impostor.client_context, server_side=False)
                    await write_frame(conn, {"name": "echo"})
                    await read_frame(conn, 0)
            finally:
                conn.abort()
                impostor.close()
            assert await eventually(lambda: b.stats["refused"] == 1) and seen == []

    asyncio.run(main())


@pytest.mark.parametrize("answer", ["plaintext after the hello", "the version-1 handshake"])
def test_a_server_cannot_downgrade_the_dialer_to_plaintext(answer):
    """A server at b's address that accepts the hello and then talks plaintext (or answers with the old plaintext
    handshake) gets no stream: the dialer falls back to the inner streams, and none of the stream's bytes reach
    the downgrader."""

    async def main():
        async with swarm(2) as (_, (a, b)):
            seen = await serve_echo(b)
            received = bytearray()

            async def downgrader(conn):
                with contextlib.suppress(Exception):
                    hello, _, _ = await read_frame(conn, 0)
                    if answer == "plaintext after the hello":
                        await write_frame(conn, {"v": 2})
                        await write_frame(conn, {})  # "name accepted", in the clear
                    else:
                        await write_frame(conn, {"v": 1, "from": b.peer_id, "nonce": b"n" * 32, "sig": b"s" * 64})
                    while data := await asyncio.wait_for(conn.read(65536), 5):
                        received.extend(data)
                conn.close()

            server = await serve_raw(downgrader)
            real = b.port
            b.port = server.sockets[0].getsockname()[1]
            await b._publish()
            b.port = real
            marker = b"secret part " * 1000
            _, echoed = await round_trip(a, b.peer_id, marker)
            server.close()
            assert echoed == marker and seen == [a.peer_id]  # through the inner (encrypted) streams
            assert a.stats["direct_failed"] == 1 and a.inner.opens == 1
            assert b"secret part" not in received and b"echo" not in received

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------- all-reduce


def test_a_flipped_byte_in_an_all_reduce_is_never_averaged_and_bans_nobody():
    """Three peers, warm connections; every connection to the third goes through a relay that flips one byte of the
    first one. Whatever a member ends with is the mean of unaltered parts (or the round fails for it), and nobody
    is banned: a broken connection is not a lie."""

    async def main():
        hub = Hub()
        peers = []
        for _ in range(3):
            signer = new_signer()
            inner = hub.transport(signer.peer_id)
            discovery = SignedDiscovery(inner.discovery, signer)
            streams = DirectStreams(inner.streams, discovery, signer, "127.0.0.1", multiplex=True)
            await streams.start()
            ar = ButterflyAllReduce(types.SimpleNamespace(discovery=discovery, streams=streams), "run",
                                    AllReduceConfig("none", 3.0, 6.0, chunk_numel=4096))
            await ar.start()
            peers.append((streams, ar))
        target = max((s for s, _ in peers), key=lambda s: s.peer_id)  # the others dial it (smaller PeerIDs dial)
        relay = await through(target, target, flip_at=60_000)
        try:
            numel = 3 * 8 * 4096
            xs = [torch.full((numel,), float(10 ** i)) for i in range(3)]  # each member's contribution is visible
            members = tuple(sorted(s.peer_id for s, _ in peers))
            group = Group("g", "r0", members[0], members, {m: {} for m in members})
            out = await asyncio.gather(*[ar.run(group, x, 1.0) for (_, ar), x in zip(peers, xs)],
                                       return_exceptions=True)
            assert relay.flips == 1
            allowed = {sum(10.0 ** i for i in subset) / len(subset)
                       for subset in [(0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)]}
            results = [o for o in out if not isinstance(o, BaseException)]
            for o in out:
                assert not isinstance(o, BaseException) or isinstance(o, AllReduceFailed), repr(o)
            for result in results:
                assert set(result.averaged.unique().tolist()) <= allowed  # means of whole, unaltered parts only
            for streams, ar in peers:
                assert ar.bans.active() == {}
            print(f"FIGURE flipped byte in an all-reduce: {len(results)} of 3 members ended with a result, "
                  f"{len(out) - len(results)} failed the round, 0 banned")
        finally:
            relay.close()
            for streams, ar in peers:
                await ar.stop()
                await streams.stop()

    asyncio.run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_large_read_over_tls_asks_the_kernel_for_most_of_its_bytes_per_wakeup_and_completes_on_a_trickle(loop):
    """While a large ``readexactly`` waits, the socket's SO_RCVLOWAT holds the reader's wakeup until most of the
    missing bytes are queued (capped, and less what one TLS record may hold undelivered): the writer trickles 10 KB
    pieces, the read completes with every byte, the option is back at 1 afterwards, and a 5-byte read that follows
    needs no more than its 5 bytes."""
    import socket

    import uvloop

    from peerd.transport import connection

    payload = os.urandom(600_000)
    client_tls, server_tls = PeerTLS(new_signer()), PeerTLS(new_signer())

    async def main():
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connection(conn):
            accepted.set_result(conn)

        server = await serve_raw(on_connection)
        client = await open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        conn = await accepted
        await asyncio.gather(client.start_tls(client_tls.client_context, server_side=False),
                             conn.start_tls(server_tls.server_context(client_tls.certificate), server_side=True))
        sock = conn.get_extra_info("socket")

        def lowat() -> int:
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)

        reading = asyncio.ensure_future(conn.readexactly(len(payload)))
        assert await eventually(lambda: lowat() > 1)
        assert lowat() == min(connection.RCVLOWAT_MAX_BYTES, len(payload) - connection._LOWAT_SLACK_BYTES)
        for start in range(0, len(payload), 10_000):
            client.write(payload[start:start + 10_000])
            await asyncio.sleep(0.002)
        assert await asyncio.wait_for(reading, 30) == payload
        assert lowat() == 1
        client.write(b"tail!")
        assert await asyncio.wait_for(conn.readexactly(5), 10) == b"tail!"
        client.close()
        conn.close()
        server.close()

    try:
        (uvloop.run if loop == "uvloop" else asyncio.run)(main())
    finally:
        client_tls.close()
        server_tls.close()
