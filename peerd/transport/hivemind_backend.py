"""The default transport: hivemind's Kademlia DHT for discovery and its libp2p daemon (p2pd) for peer streams.

By default (node config ``dht = "process"``) the DHT runs in a child process with its own p2pd; this process
attaches a second client to the same p2pd (``DHT.replicate_p2p``), so both share one PeerID and one set of listening
sockets. With ``dht = "inline"`` the DHT node runs in this process's event loop on a p2pd this process starts
(:class:`~peerd.transport.hivemind_dht.InlineDHT`): no second Python interpreter and no torch shared-memory manager (hivemind's ``DHT`` pipes its
futures through torch shared memory), ~250 MB less per peer (tiny model: 696 -> 444 MB, docs/benchmarks.md), for
many peers on one machine; DHT maintenance then shares this process's CPU with training. Peer streams are raw libp2p
streams (``add_binary_stream_handler``): peerd frames them itself (:mod:`protocols.wire`), avoiding a protobuf
message per tensor part.

The DHT process and its p2pd die with this process, however it dies, and stop within a bounded time
(:mod:`peerd.transport.hivemind_dht`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from peerd.config import DHT_MODES
from peerd.transport.hivemind_dht import InlineDHT, start_dht_process, stop_dht_process
from peerd.transport.linger import serve_stream
from peerd.transport.p2pd_errors import P2PD_ERRORS
from protocols.interfaces import Record, StreamHandler

logger = logging.getLogger(__name__)


#: Most remote addresses of incoming streams remembered (one per peer).
OBSERVED_MAX = 4096


def relay_options(relay: str, client_mode: bool = False, relays: Sequence[str] = ()) -> dict[str, Any]:
    """hivemind ``P2P.create`` options of the node config's ``relay``: ``off`` = no circuit relay at all;
    ``auto`` = the relay transport and relay service on (a reachable peer relays for others: p2pd's
    ``-relayService`` is on with ``-relay``) plus auto-relay (p2pd reserves a slot on a relay once its AutoNAT
    finds it unreachable); ``always`` = as auto, with the reachability forced private so it keeps a relay slot
    whatever AutoNAT says. A short-lived client (``client_mode``) never reserves a slot.

    ``relays``: multiaddrs (with ``/p2p/<PeerID>``) of the peers to reserve slots on, normally the initial
    (bootstrap) peers: they become p2pd's static relays (``trusted_relays`` and the p2pd flag
    ``relayDiscovery=0``, returned under the key ``p2pd_flags``), and go-libp2p's auto-relay then reserves on them
    as soon as it is unreachable. Without them p2pd discovers relays through its DHT, and go-libp2p (autorelay
    v0.32: at least 4 candidates or a 3-minute boot delay) waits up to 3 minutes before its first reservation."""
    if relay not in ("off", "auto", "always"):
        raise ValueError(f"relay must be off, auto or always, got {relay!r}")
    if relay == "off":
        return {"use_relay": False, "use_auto_relay": False}
    options: dict[str, Any] = {"use_relay": True, "use_auto_relay": not client_mode}
    if relay == "always" and not client_mode:
        options["force_reachability"] = "private"
    static = [r for r in dict.fromkeys(relays) if "/p2p/" in r]
    if options["use_auto_relay"] and static:
        options["trusted_relays"] = static
        options["p2pd_flags"] = {"relayDiscovery": False}
    return options


class BootstrapUnreachable(ConnectionError):
    """The DHT node could not start because none of its initial peers answered (they may be down, or only slow)."""


def dht_start_error(error: BaseException, initial_peers: Sequence[str]) -> ConnectionError:
    """The error a DHT node that could not start raises: ``error``, plus what to check where the cause is that no
    initial peer answered (p2pd says "failed to connect to bootstrap peers", hivemind's DHT node "none of the
    initial_peers responded to a ping", the light node times out): then a :class:`BootstrapUnreachable`."""
    message = f"could not start the DHT node: {error}"
    text = str(error)
    if initial_peers and ("bootstrap peers" in text or "initial_peers responded" in text
                          or isinstance(error, TimeoutError)):
        message += (f"; none of the {len(initial_peers)} initial peer(s) answered: check that the node at "
                    f"{initial_peers[0]} is running and that the address and PeerID are its current ones")
        return BootstrapUnreachable(message)
    return ConnectionError(message)


def unexpired_records(found: Any, now: float) -> dict[str, Record]:
    """Subkey -> :class:`Record` of a hivemind DHT ``get`` result (``ValueWithExpiration`` of a dictionary, or
    None) whose expiration time (DHT time, seconds) is after ``now``; {} if nothing or no dictionary was found."""
    if found is None or not isinstance(found.value, dict):
        return {}
    return {str(subkey): Record(item.value, item.expiration_time)
            for subkey, item in found.value.items() if item.expiration_time > now}


class HivemindDiscovery:
    """:class:`protocols.interfaces.Discovery` on a running :class:`hivemind.DHT`."""

    def __init__(self, dht: hivemind.DHT):
        self.dht = dht

    def time(self) -> float:
        return get_dht_time()

    async def store(self, key: str, subkey: str, value: Any, expiration_time: float) -> bool:
        return bool(await self.dht.store(key, value, expiration_time, subkey=subkey, return_future=True))

    async def get(self, key: str) -> dict[str, Record]:
        return unexpired_records(await self.dht.get(key, latest=True, return_future=True), self.time())


class NodeDiscovery:
    """:class:`protocols.interfaces.Discovery` on a :class:`hivemind.dht.DHTNode` in this process's event loop."""

    def __init__(self, node: DHTNode):
        self.node = node

    def time(self) -> float:
        return get_dht_time()

    async def store(self, key: str, subkey: str, value: Any, expiration_time: float) -> bool:
        return bool(await self.node.store(key, value, expiration_time, subkey=subkey))

    async def get(self, key: str) -> dict[str, Record]:
        return unexpired_records(await self.node.get(key, latest=True), self.time())


class HivemindStreams:
    """:class:`protocols.interfaces.PeerStreams` on p2pd binary streams."""

    def __init__(self, p2p: P2P):
        self.p2p = p2p
        self._peer_id = p2p.peer_id.to_base58()
        self._served: set[str] = set()
        self.observed: dict[str, str] = {}
        """PeerID -> remote multiaddr of the last stream it opened to us (what the dial-back check calls the
        address a request came from); at most OBSERVED_MAX entries, oldest dropped first."""

    @property
    def peer_id(self) -> str:
        return self._peer_id

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        if name in self._served:
            raise ValueError(f"handler {name!r} is already served")

        async def serve(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._observe(info)
            try:
                await serve_stream(handler, info.peer_id.to_base58(), reader, writer, name)
            finally:
                writer.close()

        await self.p2p.add_binary_stream_handler(name, serve)
        self._served.add(name)

    def _observe(self, info: Any) -> None:
        with contextlib.suppress(ValueError):  # an address p2pd reports that does not decode is not recorded
            peer, addr = info.peer_id.to_base58(), str(info.addr)
            if addr:
                self.observed.pop(peer, None)
                self.observed[peer] = addr
                if len(self.observed) > OBSERVED_MAX:
                    del self.observed[next(iter(self.observed))]

    async def remove_handler(self, name: str) -> None:
        if name in self._served:
            self._served.discard(name)
            with contextlib.suppress(*P2PD_ERRORS):  # p2pd gone or refusing: nothing is served there any more
                await self.p2p.remove_binary_stream_handler(name)

    async def connect(self, maddr: str, timeout_s: float = 20.0) -> None:
        """Open a connection to the peer at ``maddr`` (``.../p2p/<PeerID>``; a relay circuit
        ``<relay>/p2p-circuit/p2p/<PeerID>`` goes through that relay), so that later streams to it can use it.
        Raises ConnectionError if it cannot be reached within ``timeout_s``."""
        from multiaddr import Multiaddr

        head, sep, peer = maddr.rstrip("/").rpartition("/p2p/")
        if not sep or not head:
            raise ValueError(f"{maddr!r} does not end with /p2p/<PeerID>")
        try:
            await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(head)]), timeout_s)
        except P2PD_ERRORS as e:  # a timeout, or p2pd's ControlFailure for a failed dial
            raise ConnectionError(f"cannot connect to {maddr}: {e}") from e

    async def open(self, peer_id: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
        except (ConnectionError, OSError):
            raise
        except P2PD_ERRORS as e:  # p2pd reports dial failures as ControlFailure / P2PDaemonError
            raise ConnectionError(f"cannot open {name!r} to {peer_id}: {e}") from e
        return reader, writer


@dataclass
class HivemindTransport:
    """Discovery and streams of one peer on hivemind. Create with :meth:`create`, release with :meth:`shutdown`."""

    dht: "hivemind.DHT | InlineDHT"
    discovery: "HivemindDiscovery | NodeDiscovery"
    streams: HivemindStreams
    on_shutdown: list[Callable[[], None]] = field(default_factory=list)
    """Called after the DHT process is gone (e.g. releasing the identity lock); a callback must not raise."""

    @classmethod
    async def create(
        cls,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        identity_path: Optional[str] = None,
        nat_port_map: bool = False,
        client_mode: bool = False,
        startup_timeout_s: float = 30.0,
        record_validators: Sequence[Any] = (),
        relay: str = "off",
        dht: str = "process",
    ) -> "HivemindTransport":
        """Start a DHT node (child process + p2pd; ``dht = "inline"``: in this event loop, :class:`InlineDHT`) and
        attach streams to it.

        ``record_validators`` (hivemind ``RecordValidatorBase`` instances, e.g.
        :class:`peerd.transport.records.OwnerRecordValidator`) check every record this node is asked to store and
        every record it reads from others. ``relay`` (node config ``relay``): ``off``, ``auto`` or ``always``
        (:func:`relay_options`).

        Raises ConnectionError if none of ``initial_peers`` can be reached, ValueError for an unknown ``dht``.
        """
        if dht not in DHT_MODES:
            raise ValueError(f"dht must be one of {', '.join(DHT_MODES)}, got {dht!r}")
        p2p_options: dict[str, Any] = dict(  # hivemind P2P.create's (p2pd_flags: _TiedDHT's / InlineDHT's)
            host_maddrs=list(host_maddrs),
            identity_path=identity_path,
            nat_port_map=nat_port_map,
            **relay_options(relay, client_mode, relays=initial_peers),
            use_ipfs=False,
            check_if_identity_free=False,
            startup_timeout=startup_timeout_s,
        )
        if announce_maddrs:
            p2p_options["announce_maddrs"] = list(announce_maddrs)
        node_options = dict(initial_peers=list(initial_peers), client_mode=client_mode,
                            record_validators=list(record_validators))
        try:
            if dht == "inline":
                inline = await InlineDHT.create(**node_options, **p2p_options)
                return cls(inline, NodeDiscovery(inline.node), HivemindStreams(inline.p2p))
            child = await start_dht_process(**node_options, **p2p_options)
        except Exception as e:  # boundary: hivemind's start-up forwards any error of its node; named for the user
            raise dht_start_error(e, initial_peers) from e
        try:
            p2p = await child.replicate_p2p()
        except BaseException:
            await stop_dht_process(child)
            raise
        return cls(child, HivemindDiscovery(child), HivemindStreams(p2p))

    @property
    def peer_id(self) -> str:
        return self.streams.peer_id

    def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (with ``/p2p/<PeerID>``) other peers can use as ``--initial-peers``."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def shutdown(self) -> None:
        if isinstance(self.dht, InlineDHT):  # one p2p client, the node's: the node goes first
            try:
                await self.dht.aclose()
            finally:
                self._released()
            return
        await self.streams.p2p.shutdown()  # a client of the DHT process's p2pd: closes its sockets, never raises
        try:
            await stop_dht_process(self.dht)
        finally:
            self._released()

    def _released(self) -> None:
        for callback in self.on_shutdown:
            callback()
        self.on_shutdown.clear()
