"""Building this peer's transport from its node config: the one place that names a backend.

:func:`open_transport` holds the identity file (an advisory lock until ``shutdown()``), starts the DHT node and
streams (hivemind's DHT on p2pd, :mod:`peerd.transport.hivemind_backend`, or on py-libp2p,
:mod:`peerd.transport.libp2p_backend`, by the node config's ``transport``), signs what the peer stores and
verifies what it reads (:mod:`peerd.transport.records`). :func:`start_data_plane` moves peer streams onto the
direct TLS data plane (:mod:`peerd.transport.direct`; the default, ``data_plane = "p2p"`` keeps them on p2pd).
:func:`open_reader` is a short-lived DHT client with no identity, for ``peerd status``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Awaitable, Callable, Optional, Sequence, TypeVar

from peerd.config import NodeConfig
from peerd.identity.key import IdentityHold, hold_identity, load_or_create_identity
from peerd.identity.signing import Signer
from peerd.transport.hivemind_backend import BootstrapUnreachable, HivemindTransport
from peerd.transport.records import OwnerRecordValidator, SignedDiscovery

logger = logging.getLogger(__name__)

#: Seconds to wait before each further attempt to start the DHT node when no initial peer answered: a bootstrap node
#: restarting, or answering too late on a loaded machine (one of 64 workers started together failed its only try).
BOOTSTRAP_RETRY_S = (5.0, 15.0)

#: Where every daemon kept its identity before it moved into the checkpoint dir.
LEGACY_IDENTITY = "~/.peerd/identity.key"

T = TypeVar("T")


async def retry_unreachable(create: Callable[[], Awaitable[T]],
                            retry_s: Sequence[float] = BOOTSTRAP_RETRY_S) -> T:
    """``await create()``; when it raises :class:`BootstrapUnreachable` (no initial peer answered), again after each
    of ``retry_s`` (seconds), warning each time. Raises the last attempt's BootstrapUnreachable, and any other error
    of an attempt at once (not worth another try: a port in use, a bad identity)."""
    for attempt, wait_s in enumerate(retry_s, start=1):
        try:
            return await create()
        except BootstrapUnreachable as e:
            logger.warning("%s; trying again in %g s (attempt %d of %d)", e, wait_s, attempt + 1, len(retry_s) + 1)
            await asyncio.sleep(wait_s)
    return await create()


def transport_class(node: NodeConfig, quiet: bool = False) -> type[HivemindTransport]:
    """The transport class the node config's ``transport`` picks (``auto`` decides here and logs why, once per
    call; at DEBUG level when ``quiet``, e.g. for a query client). Raises ConnectionError if ``auto`` finds no
    usable backend."""
    from peerd.transport.libp2p_backend import LibP2PTransport, choose_backend

    backend, why = choose_backend(node.transport)
    if node.transport == "auto":
        logger.log(logging.DEBUG if quiet else logging.INFO, "transport %s (%s)", backend, why)
    return LibP2PTransport if backend == "libp2p" else HivemindTransport


async def open_transport(node: NodeConfig, role: str = "worker", client_mode: bool = False,
                         hold: Optional[IdentityHold] = None,
                         bootstrap_retry_s: tuple[float, ...] = BOOTSTRAP_RETRY_S) -> HivemindTransport:
    """The DHT node and streams of this peer (``role``: "worker" or "bootstrap", which picks the default identity
    file, :meth:`NodeConfig.identity_path_for`). Its DHT node refuses forged owner records (OwnerRecordValidator),
    and its discovery signs what this peer stores and returns only validly signed records (SignedDiscovery).

    The identity file stays locked until ``transport.shutdown()`` (``hold``: a lock the caller already took with
    :func:`peerd.identity.key.hold_identity`, e.g. before anything else starts; it is released on failure and on
    shutdown). When no initial peer answers, it tries again after each of ``bootstrap_retry_s`` (seconds), warning
    each time. Raises IdentityInUse if another daemon holds it, IdentityError if it is unusable, ConnectionError if
    the DHT node cannot start (:class:`BootstrapUnreachable` if no initial peer answered any attempt)."""
    path = node.identity_path_for(role)
    identity = str(path)
    hold = hold if hold is not None else hold_identity(path)
    try:
        peer_id = load_or_create_identity(identity)
        signer = Signer.from_identity_file(identity)
        logger.info("PeerID %s (identity %s)", peer_id, identity)
        legacy = Path(LEGACY_IDENTITY).expanduser()
        if node.identity is None and role == "worker" and legacy.exists() and legacy != path:
            logger.warning("%s, the identity of earlier peerd versions, is no longer the default; pass --identity %s "
                           "to keep its PeerID", LEGACY_IDENTITY, LEGACY_IDENTITY)
        cls = transport_class(node, quiet=client_mode)
        transport = await retry_unreachable(lambda: cls.create(
            initial_peers=node.initial_peers,
            host_maddrs=node.host_maddrs,
            announce_maddrs=node.announce_maddrs,
            identity_path=identity,
            nat_port_map=node.nat_port_map,
            client_mode=client_mode,
            record_validators=[OwnerRecordValidator()],
            relay=node.relay,
            dht=node.dht,
        ), bootstrap_retry_s)
    except BaseException:
        hold.release()
        raise
    transport.on_shutdown.append(hold.release)
    transport.discovery = SignedDiscovery(transport.discovery, signer)
    return transport


async def open_reader(node: NodeConfig) -> HivemindTransport:
    """A DHT client (no identity of ours, listening on 127.0.0.1 only, serving nothing) whose discovery returns
    only validly signed records. Call ``shutdown()`` when done."""
    transport = await transport_class(node, quiet=True).create(
        initial_peers=node.initial_peers, host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True,
        record_validators=[OwnerRecordValidator()],
    )
    transport.discovery = SignedDiscovery(transport.discovery, signer=None)
    return transport


def _ip4(maddr: str) -> Optional[str]:
    parts = maddr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] == "ip4" else None


async def start_data_plane(node: NodeConfig, transport: HivemindTransport) -> Optional[HivemindTransport]:
    """With ``data_plane = "direct"`` (the default): ``transport`` with its streams moved onto the direct TCP data
    plane (:class:`peerd.transport.direct.DirectStreams` with one warm multiplexed connection per peer pair,
    listening on the host of ``host_maddrs`` at ``data_port`` and announcing the host of ``announce_maddrs``, else
    the first non-loopback address we are visible at). Its address is published at once if we listen on loopback
    only (every peer that can reach us shares this machine), else only once the caller calls ``set_dialable(True)``
    (the daemon: when the dial-back check says others can dial this peer); until then peers reach us through p2pd,
    and our streams go direct to every peer that published. None with ``p2p``, or if no
    address to announce is known (then streams stay on p2pd, with a warning)."""
    if node.data_plane != "direct":
        return None
    from peerd.transport.dialback import listens_on_loopback_only
    from peerd.transport.direct import DirectStreams

    host = next(filter(None, map(_ip4, node.host_maddrs)), "0.0.0.0")
    announce = next(filter(None, map(_ip4, node.announce_maddrs)), None)
    if announce is None and host != "0.0.0.0":
        announce = host
    if announce is None:
        visible = [ip for ip in map(_ip4, transport.visible_maddrs()) if ip and ip != "0.0.0.0"]
        announce = next((ip for ip in visible if not ip.startswith("127.")), visible[0] if visible else None)
    if announce is None:
        logger.warning("data_plane = direct, but no IPv4 address to announce is known (set announce_maddrs): "
                       "peer streams stay on p2p")
        return None
    discovery: SignedDiscovery = transport.discovery
    # warm multiplexed connections: as fast or faster than a connection per stream in every measured scenario, and
    # 1.2x faster than p2pd's streams with 8 peers at 100 Mbit/s, at 0.6x the CPU (docs/benchmarks.md)
    streams = DirectStreams(transport.streams, discovery, discovery.signer, host, node.data_port, announce,
                            multiplex=True, publish=listens_on_loopback_only(node.host_maddrs))
    await streams.start()
    return dataclasses.replace(transport, streams=streams)
