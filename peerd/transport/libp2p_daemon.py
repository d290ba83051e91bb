"""A libp2p daemon written in Python on py-libp2p that speaks the p2pd control protocol hivemind's ``P2P`` uses.

Run as ``python -m peerd.transport.libp2p_daemon --control /tmp/x.sock ...`` (by
:mod:`peerd.transport.libp2p_backend`, never by hand). It is a drop-in for the Go ``p2pd`` binary on the subset of
its control protocol that hivemind's ``P2P`` client sends (IDENTIFY, CONNECT, STREAM_OPEN, STREAM_HANDLER,
REMOVE_STREAM_HANDLER, LIST_PEERS, DISCONNECT and the persistent connection with unary handlers), so hivemind's
DHT and peerd's streams run on it unchanged, and its peers speak the same wire protocols as p2pd peers:

- binary streams: a libp2p stream whose protocol id is the handler name, bytes piped to/from the client's socket;
- unary calls (hivemind's DHT RPCs): a libp2p stream with the handler name as protocol id carrying one
  varint-delimited ``PersistentConnectionRequest`` (``callUnary``) and answered by one (``unaryResponse``), exactly
  as go-libp2p-daemon's ``persistentStreamHandler`` does;
- peer routing: a Kademlia DHT (``/ipfs/kad/1.0.0``, server mode) finds the addresses of PeerIDs it has not met,
  as p2pd's own kad-DHT does; peers of both kinds answer each other's FIND_NODE.

Why a separate process, not a trio thread inside the daemon: py-libp2p's generated protobuf modules and hivemind's
both register ``crypto.pb.KeyType`` (from different ``.proto`` files) in protobuf's one default descriptor pool, so
importing both in one process fails (``TypeError: duplicate symbol 'crypto.pb.KeyType'``). This module therefore
never imports hivemind; it loads hivemind's ``p2pd_pb2`` module (package ``p2pclient.p2pd.pb``, no imports) from
its file, outside the ``hivemind`` package (:mod:`peerd.transport.libp2p_control`).

Threading model: one process, one thread, one trio event loop. Everything (control connections, libp2p streams,
the DHT) is a trio task; nothing polls. The process exits when its parent goes away: the parent holds the write end
of our stdin, and its EOF (on any death of the parent, SIGKILL included) ends the run. mDNS and UPnP are off.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import multiaddr
import trio
from google.protobuf.message import DecodeError
from libp2p import new_host
from libp2p.abc import INotifee
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.exceptions import BaseLibp2pError
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.tools.anyio_service import background_trio_service

from peerd.config import RELAY_MODES
from peerd.transport.libp2p_control import (
    PIPE_CHUNK, Reader, delimited, key_pair_from_identity, pb, remote_maddr, stream_receive,
)
from peerd.transport.libp2p_relay import concrete_addrs, reserve_on_relays, wants_reservation

logger = logging.getLogger("peerd.libp2p_daemon")

#: How long a dial (including a DHT lookup of the peer's addresses) may take, in seconds.
DIAL_TIMEOUT_S = 15.0
#: The line printed on stdout once the control socket listens (the parent waits for it).
READY_LINE = "peerd-libp2p-daemon ready"
#: What a broken control socket or libp2p stream raises: trio's for a socket closed or gone, OSError, EOFError (an
#: end of input mid-message), and py-libp2p's own errors (StreamReset, StreamClosed, MuxedStreamError ...: all
#: BaseLibp2pError).
BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError, EOFError, BaseLibp2pError)
#: What a message that does not parse raises: a bad varint or an oversized length (ValueError), bad protobuf.
MALFORMED = (ValueError, DecodeError)


class _ConnectNotifee(INotifee):
    """Adds every peer we connect to (either direction) to the Kademlia routing table: how a p2pd peer that dialed
    us becomes findable by others asking us."""

    def __init__(self, daemon: "Daemon"):
        self.daemon = daemon

    async def opened_stream(self, network: Any, stream: Any) -> None:
        pass

    async def closed_stream(self, network: Any, stream: Any) -> None:
        pass

    async def connected(self, network: Any, conn: Any) -> None:
        self.daemon.nursery.start_soon(self.daemon.add_to_routing_table, conn.muxed_conn.peer_id)

    async def disconnected(self, network: Any, conn: Any) -> None:
        pass

    async def listen(self, network: Any, multiaddr: Any) -> None:
        pass

    async def listen_close(self, network: Any, multiaddr: Any) -> None:
        pass


class Daemon:
    """The running daemon: a py-libp2p host, its Kademlia DHT and the control socket."""

    def __init__(self, host: Any, dht: KadDHT, nursery: trio.Nursery):
        self.circuits: list[str] = []  # our /p2p-circuit addresses through relays that gave us a slot
        self.host, self.dht, self.nursery = host, dht, nursery
        self.stream_handlers: dict[str, str] = {}  # protocol -> client socket path
        self.unary_handlers: dict[str, Any] = {}  # protocol -> the persistent connection that serves it
        self.response_waiters: dict[bytes, trio.MemorySendChannel] = {}

    # ------------------------------------------------------------------------------------------------ dialing

    async def add_to_routing_table(self, peer_id: ID) -> None:
        await trio.sleep(0.5)  # identify first: the table keeps only peers that speak the kad protocol
        try:
            await self.dht.add_peer(peer_id)
        except Exception as e:  # boundary: a task of the daemon's nursery; a peer we cannot add is not routed through
            logger.debug("routing table refused %s: %s", peer_id, e)

    async def ensure_connected(self, peer_id: ID) -> None:
        if self.host.get_network().get_connections(peer_id):
            return
        with trio.fail_after(DIAL_TIMEOUT_S):
            addrs = []
            try:
                addrs = self.host.get_peerstore().addrs(peer_id)
            except KeyError:  # PeerStoreError: no known address
                pass
            if addrs:
                try:
                    await self.host.connect(PeerInfo(peer_id, addrs))
                    return
                except (*BROKEN, trio.TooSlowError) as e:  # SwarmException ...: stale addresses, look the peer up
                    logger.debug("dial %s at known addresses failed: %s", peer_id, e)
            info = await self.dht.find_peer(peer_id)
            if info is None or not info.addrs:
                raise ConnectionError(f"no address known for {peer_id}")
            await self.host.connect(info)

    async def new_stream(self, peer_id: ID, protos: list[str]) -> Any:
        await self.ensure_connected(peer_id)
        with trio.fail_after(DIAL_TIMEOUT_S):
            return await self.host.new_stream(peer_id, protos)

    # ------------------------------------------------------------------------------------------------ piping

    async def pipe(self, sock: trio.SocketStream, stream: Any, already_read: bytes = b"") -> None:
        """Copy bytes both ways until both sides finished; a reset or a broken socket ends both at once."""
        from libp2p.network.stream.exceptions import StreamEOF

        async def to_peer(cancel: trio.CancelScope) -> None:
            try:
                if already_read:
                    await stream.write(already_read)
                while True:
                    data = await sock.receive_some(PIPE_CHUNK)
                    if not data:
                        await stream.close_write()
                        return
                    await stream.write(data)
            except BROKEN:  # either side broke: tear both down
                cancel.cancel()

        async def to_client(cancel: trio.CancelScope) -> None:
            try:
                while True:
                    try:
                        data = await stream.read(PIPE_CHUNK)
                    except StreamEOF:
                        data = b""
                    if not data:
                        await sock.send_eof()
                        return
                    await sock.send_all(data)
            except BROKEN:
                cancel.cancel()

        clean = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(to_peer, nursery.cancel_scope)
                nursery.start_soon(to_client, nursery.cancel_scope)
            clean = not nursery.cancel_scope.cancelled_caught
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await (stream.close() if clean else stream.reset())
                except BROKEN:
                    pass
                await sock.aclose()

    # ------------------------------------------------------------------------------------------------ control

    async def serve_control(self, sock: trio.SocketStream) -> None:
        reader = Reader(sock.receive_some)
        try:
            request = await reader.message(pb.Request())
        except (*BROKEN, *MALFORMED):  # a client that went away before asking, or garbled its request
            await sock.aclose()
            return
        kind = request.type
        if kind == pb.Request.PERSISTENT_CONN_UPGRADE:
            await sock.send_all(delimited(pb.Response(type=pb.Response.OK)))
            await self.serve_persistent(sock, reader)
            return
        if kind == pb.Request.STREAM_OPEN:
            try:
                peer_id = ID(request.streamOpen.peer)
                stream = await self.new_stream(peer_id, list(request.streamOpen.proto))
            except Exception as e:  # boundary: any dial failure (TooSlowError included) is the client's ControlFailure
                await self._error(sock, f"cannot open stream: {type(e).__name__}: {e}")
                return
            info = pb.StreamInfo(peer=peer_id.to_bytes(), addr=remote_maddr(stream), proto=stream.get_protocol())
            await sock.send_all(delimited(pb.Response(type=pb.Response.OK, streamInfo=info)))
            await self.pipe(sock, stream, reader.take_buffered())
            return
        try:
            response = await self.control_request(request)
        except Exception as e:  # boundary: whatever a request fails with is answered as an error, never raised
            response = pb.Response(type=pb.Response.ERROR, error=pb.ErrorResponse(msg=f"{type(e).__name__}: {e}"))
        try:
            await sock.send_all(delimited(response))
        except BROKEN:  # the client went away
            pass
        await sock.aclose()

    async def _error(self, sock: trio.SocketStream, message: str) -> None:
        try:
            await sock.send_all(delimited(pb.Response(type=pb.Response.ERROR, error=pb.ErrorResponse(msg=message))))
        except BROKEN:  # the client went away
            pass
        await sock.aclose()

    async def control_request(self, request: Any) -> Any:
        ok = pb.Response(type=pb.Response.OK)
        kind = request.type
        if kind == pb.Request.IDENTIFY:
            ok.identify.id = self.host.get_id().to_bytes()
            ok.identify.addrs.extend(self._own_addrs())
        elif kind == pb.Request.CONNECT:
            peer_id = ID(request.connect.peer)
            addrs = [multiaddr.Multiaddr(a) for a in request.connect.addrs]
            with trio.fail_after(DIAL_TIMEOUT_S):
                if addrs:
                    await self.host.connect(PeerInfo(peer_id, addrs))
                else:
                    await self.ensure_connected(peer_id)
        elif kind == pb.Request.STREAM_HANDLER:
            path = multiaddr.Multiaddr(request.streamHandler.addr).value_for_protocol("unix")
            for proto in request.streamHandler.proto:
                self.stream_handlers[proto] = path
                self.host.set_stream_handler(proto, self._binary_handler(proto))
        elif kind == pb.Request.REMOVE_STREAM_HANDLER:
            for proto in request.removeStreamHandler.proto:
                if self.stream_handlers.pop(proto, None) is not None:
                    self.host.remove_stream_handler(proto)
        elif kind == pb.Request.LIST_PEERS:
            for peer_id, conns in self.host.get_network().get_connections_map().items():
                if conns:
                    info = ok.peers.add()
                    info.id = peer_id.to_bytes()
                    try:
                        info.addrs.extend(a.to_bytes() for a in self.host.get_peerstore().addrs(peer_id))
                    except KeyError:  # PeerStoreError: connected, but no address kept
                        pass
        elif kind == pb.Request.DISCONNECT:
            await self.host.disconnect(ID(request.disconnect.peer))
        else:
            raise ValueError(f"request type {kind} is not supported by this daemon")
        return ok

    def _own_addrs(self) -> list[bytes]:
        out = []
        for addr in self.host.get_addrs():
            text = str(addr).split("/p2p/")[0]
            out.append(multiaddr.Multiaddr(text).to_bytes())
        return out + [multiaddr.Multiaddr(a).to_bytes() for a in self.circuits]

    def _binary_handler(self, proto: str) -> Callable[[Any], Awaitable[None]]:
        async def handle(stream: Any) -> None:
            path = self.stream_handlers.get(proto)
            if path is None:
                await stream.reset()
                return
            try:
                sock = await trio.open_unix_socket(path)
            except OSError:
                await stream.reset()
                return
            peer_id = stream.muxed_conn.peer_id
            info = pb.StreamInfo(peer=peer_id.to_bytes(), addr=remote_maddr(stream), proto=proto)
            try:
                await sock.send_all(delimited(info))
            except BROKEN:  # the client went away
                await stream.reset()
                await sock.aclose()
                return
            await self.pipe(sock, stream)

        return handle

    # ------------------------------------------------------------------------------------------------ unary

    async def serve_persistent(self, sock: trio.SocketStream, reader: Reader) -> None:
        lock = trio.Lock()
        mine: list[str] = []

        async def send(message: Any) -> None:
            async with lock:
                await sock.send_all(delimited(message))

        cancels: dict[bytes, trio.CancelScope] = {}
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        request = await reader.message(pb.PersistentConnectionRequest())
                    except (*BROKEN, *MALFORMED):  # the client closed its persistent connection (or garbled it)
                        nursery.cancel_scope.cancel()
                        break
                    nursery.start_soon(self._persistent_request, request, send, mine, cancels)
        finally:
            for proto in mine:
                if self.unary_handlers.get(proto) is send:
                    del self.unary_handlers[proto]
                    self.host.remove_stream_handler(proto)
            with trio.CancelScope(shield=True):
                await sock.aclose()

    async def _persistent_request(self, request: Any, send: Callable[[Any], Awaitable[None]], mine: list[str],
                                  cancels: dict[bytes, trio.CancelScope]) -> None:
        call_id = request.callId
        which = request.WhichOneof("message")
        response = pb.PersistentConnectionResponse(callId=call_id)
        if which == "addUnaryHandler":
            proto = request.addUnaryHandler.proto
            if proto in self.unary_handlers:
                response.daemonError.message = f"handler for protocol {proto} already set"
            else:
                self.unary_handlers[proto] = send
                mine.append(proto)
                self.host.set_stream_handler(proto, self._unary_handler(proto))
            await send(response)
        elif which == "removeUnaryHandler":
            proto = request.removeUnaryHandler.proto
            if self.unary_handlers.get(proto) is send:
                del self.unary_handlers[proto]
                mine.remove(proto)
                self.host.remove_stream_handler(proto)
            else:
                response.daemonError.message = f"handler for protocol {proto} was not created in this connection"
            await send(response)
        elif which == "callUnary":
            with trio.CancelScope() as scope:
                cancels[call_id] = scope
                try:
                    response = await self._call_unary(request)
                finally:
                    cancels.pop(call_id, None)
            if scope.cancelled_caught:
                response = pb.PersistentConnectionResponse(callId=call_id)
                response.cancel.SetInParent()
            try:
                await send(response)
            except BROKEN:  # the client is gone
                pass
        elif which == "unaryResponse":
            waiter = self.response_waiters.get(call_id)
            if waiter is not None:
                try:
                    waiter.send_nowait(request)
                except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
        elif which == "cancel":
            scope = cancels.get(call_id)
            if scope is not None:
                scope.cancel()

    async def _call_unary(self, request: Any) -> Any:
        call_id = request.callId
        response = pb.PersistentConnectionResponse(callId=call_id)
        stream = None
        try:
            stream = await self.new_stream(ID(request.callUnary.peer), [request.callUnary.proto])
            await stream.write(delimited(request))
            answer = await Reader(lambda n: stream_receive(stream, n)).message(pb.PersistentConnectionRequest())
            response.callUnaryResponse.CopyFrom(answer.unaryResponse)
        except Exception as e:  # boundary: reported to the caller as a daemon error (TooSlowError included)
            response = pb.PersistentConnectionResponse(callId=call_id)
            response.daemonError.message = f"{type(e).__name__}: {e}"
        finally:
            if stream is not None:
                with trio.CancelScope(shield=True):
                    try:
                        await stream.close()
                    except BROKEN:
                        pass
        return response

    def _unary_handler(self, proto: str) -> Callable[[Any], Awaitable[None]]:
        async def handle(stream: Any) -> None:
            try:
                send = self.unary_handlers.get(proto)
                if send is None:
                    return
                request = await Reader(lambda n: stream_receive(stream, n)).message(
                    pb.PersistentConnectionRequest())
                if request.WhichOneof("message") != "callUnary":
                    return
                request.callUnary.peer = stream.muxed_conn.peer_id.to_bytes()  # now: who is calling
                call_id = request.callId
                waiter_send, waiter_receive = trio.open_memory_channel(1)
                self.response_waiters[call_id] = waiter_send
                try:
                    handling = pb.PersistentConnectionResponse(callId=call_id)
                    handling.requestHandling.CopyFrom(request.callUnary)
                    await send(handling)
                    answer = await waiter_receive.receive()
                    await stream.write(delimited(answer))
                finally:
                    self.response_waiters.pop(call_id, None)
            except Exception as e:  # boundary: a libp2p stream handler; a broken call only ends this stream
                logger.debug("unary %s failed: %s", proto, e)
            finally:
                with trio.CancelScope(shield=True):
                    try:
                        await stream.close()
                    except BROKEN:
                        pass

        return handle


async def _serve_unix(path: str, handler: Callable[[trio.SocketStream], Awaitable[None]],
                      task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    with trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM) as sock:
        await sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(128)
        listener = trio.SocketListener(sock)
        task_status.started()

        async def serve_one(client: trio.SocketStream) -> None:
            try:
                await handler(client)
            except Exception:  # boundary: one control connection; what ends it unexpectedly must not end the daemon
                logger.exception("control connection failed")
                await client.aclose()

        await trio.serve_listeners(serve_one, [listener])


async def _wait_for_parent() -> None:
    """Return once stdin (held open by the parent) reaches EOF, i.e. the parent is gone or shut us down."""
    stdin = trio.lowlevel.FdStream(os.dup(0))
    try:
        while await stdin.receive_some(1024):
            pass
    finally:
        await stdin.aclose()


async def run(args: argparse.Namespace) -> None:
    if args.identity:
        key_pair = key_pair_from_identity(Path(args.identity).read_bytes())
    else:
        private = Ed25519PrivateKey.new()
        key_pair = KeyPair(private, private.get_public_key())
    listen = [multiaddr.Multiaddr(a) for a in args.host_addrs.split(",") if a]
    announce = [multiaddr.Multiaddr(a) for a in args.announce_addrs.split(",") if a]
    host = new_host(key_pair=key_pair, listen_addrs=listen, enable_mDNS=False, enable_upnp=False,
                    announce_addrs=announce or None)
    dht = KadDHT(host, DHTMode.SERVER)
    async with host.run(listen_addrs=listen), background_trio_service(dht):
        async with trio.open_nursery() as nursery:
            daemon = Daemon(host, dht, nursery)
            host.get_network().register_notifee(_ConnectNotifee(daemon))
            for maddr in filter(None, args.bootstrap.split(",")):
                try:
                    info = info_from_p2p_addr(multiaddr.Multiaddr(maddr))
                    with trio.fail_after(DIAL_TIMEOUT_S):
                        await host.connect(info)
                    await dht.add_peer(info.peer_id, skip_server_mode_check=True)
                except Exception as e:  # boundary: one bootstrap peer; the parent's DHT decides whether that is fatal
                    logger.warning("bootstrap peer %s unreachable: %s", maddr, e)
            relays = [a for a in args.bootstrap.split(",") if "/p2p/" in a]
            own = concrete_addrs([str(a) for a in host.get_addrs()], relays)
            if wants_reservation(args.relay, own):
                logger.info("listening on %s only (no public IP): reserving relay slots on %s", own, relays)
                nursery.start_soon(reserve_on_relays, host, relays, nursery, daemon.circuits)
            await nursery.start(_serve_unix, args.control, daemon.serve_control)
            print(READY_LINE, flush=True)
            await _wait_for_parent()
            nursery.cancel_scope.cancel()
    try:
        os.unlink(args.control)
    except OSError:
        pass


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--control", required=True, help="unix socket path of the control protocol")
    parser.add_argument("--host-addrs", default="/ip4/127.0.0.1/tcp/0")
    parser.add_argument("--announce-addrs", default="")
    parser.add_argument("--bootstrap", default="", help="comma-separated full multiaddrs (with /p2p/<PeerID>)")
    parser.add_argument("--identity", default="", help="libp2p Ed25519 PrivateKey protobuf file")
    parser.add_argument("--relay", default="off", choices=RELAY_MODES,
                        help="reserve circuit relay slots on the bootstrap peers: auto = when no listen address is "
                             "public (peerd.transport.libp2p_relay)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s libp2p-daemon %(levelname)s %(message)s")
    # py-libp2p logs every peer that hangs up mid-stream as an error: normal churn here, so only with DEBUG
    for noisy in ("libp2p", "multiaddr"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if logging.getLogger().level <= logging.DEBUG
                                          else logging.CRITICAL)
    trio.run(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
