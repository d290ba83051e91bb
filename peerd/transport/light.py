"""A light peer transport: hivemind's DHT node in *this* process's event loop, on its own p2pd.

:class:`peerd.transport.hivemind_backend.HivemindTransport` runs each peer's DHT node in a child Python process
(hivemind's ``DHT``), so a peer costs two Python interpreters plus p2pd. Here the :class:`hivemind.dht.DHTNode` is
created in the caller's event loop on a :class:`hivemind.p2p.P2P` this process starts, so one process can host
many peers: per peer only a p2pd (a small Go daemon, one PeerID and one listening socket each) and the Python
objects of its DHT node and averaging services remain. Peers of one process still talk to each other, and to
peers elsewhere, only over their p2pd sockets (loopback or network), exactly like separate processes.

Used by the standalone averaging peer (``peerd.testing.avgpeer --peers K``) to run tens of peers on one box. The
DiLoCo worker keeps :class:`HivemindTransport` (one peer per process; its node config ``dht = "inline"`` puts its
DHT node in its own event loop the same way, :class:`peerd.transport.hivemind_dht.InlineDHT`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Sequence

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from peerd.transport.hivemind_backend import HivemindStreams, NodeDiscovery, dht_start_error
from peerd.transport.hivemind_dht import start_dht_node
from peerd.transport.p2pd_errors import P2PD_ERRORS

logger = logging.getLogger(__name__)


@dataclass
class LightTransport:
    """Discovery and streams of one peer whose DHT node lives in this process. Create with :meth:`create`,
    release with :meth:`shutdown`."""

    node: DHTNode
    p2p: P2P
    discovery: NodeDiscovery
    streams: HivemindStreams

    @classmethod
    async def create(
        cls,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        nat_port_map: bool = False,
        startup_timeout_s: float = 30.0,
        num_workers: int = 4,
    ) -> "LightTransport":
        """Start a p2pd for this peer and a DHT node on it, in the running event loop.

        ``num_workers`` bounds the node's concurrent DHT requests (hivemind's default of 4 per query keeps a
        process with many peers from flooding its own loop). Raises ConnectionError if the daemon does not start,
        :class:`BootstrapUnreachable` (a ConnectionError) if none of ``initial_peers`` answered: worth another try
        (:func:`peerd.transport.factory.retry_unreachable`).
        """
        try:
            p2p = await P2P.create(
                initial_peers=list(initial_peers), host_maddrs=list(host_maddrs), nat_port_map=nat_port_map,
                use_relay=False, use_auto_relay=False, use_ipfs=False, startup_timeout=startup_timeout_s,
            )
        except P2PD_ERRORS as e:  # p2pd says "failed to connect to bootstrap peers" when none answered in time
            raise dht_start_error(e, initial_peers) from e
        try:
            node = await start_dht_node(p2p, initial_peers, startup_timeout_s, num_workers=num_workers)
        except Exception as e:  # boundary: hivemind's node start-up, any failure: p2pd stopped, the cause named
            await p2p.shutdown()  # SIGTERM to p2pd, then its exit: never raises
            raise dht_start_error(e, initial_peers) from e
        return cls(node, p2p, NodeDiscovery(node), HivemindStreams(p2p))

    @property
    def peer_id(self) -> str:
        return self.streams.peer_id

    async def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (with ``/p2p/<PeerID>``) other peers can use as ``--initial-peers``."""
        return [str(m) for m in await self.p2p.get_visible_maddrs()]

    async def shutdown(self) -> None:
        with contextlib.suppress(*P2PD_ERRORS):  # its handlers not removed: p2pd stops next anyway
            await self.node.shutdown()
        await self.p2p.shutdown()
