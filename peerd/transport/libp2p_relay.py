"""Circuit relay v2 client for the py-libp2p daemon (:mod:`peerd.transport.libp2p_daemon`): reservations on relays.

A peer behind a NAT reserves a slot on relays (the initial peers: bootstrap nodes, run with ``relay = "auto"`` on a
public address) and announces ``<relay>/p2p-circuit`` addresses; a peer that dials one reaches it through the
relay (libp2p circuit relay v2, https://github.com/libp2p/specs/blob/master/relay/circuit-v2.md). The relays may be
p2pd peers: go-libp2p's relay service and py-libp2p's client speak the same protocol (checked in
``tests/netns/test_reachability_nat.py``). This peer answers the relay's STOP streams (py-libp2p's
``CircuitV2Protocol``: the relayed connection is then secured and multiplexed like a direct one); it relays for
nobody (no HOP service) and, unlike p2pd, has no AutoNAT: :func:`wants_reservation` decides from the listen
addresses. It runs DCUtR (py-libp2p's ``DCUtRProtocol``): a peer that reached it through a relay gets a direct
connection where the NAT allows one (measured against a p2pd peer in the NAT testbed: without DCUtR the connection
stayed relayed; with it a direct connection from the router's address joined it within 4 s).

Runs inside the daemon's trio loop; imports py-libp2p (never hivemind).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any, Sequence

import multiaddr
import trio

from peerd.config import RELAY_MODES  # imports neither hivemind nor torch (this runs in the libp2p daemon)

logger = logging.getLogger("peerd.libp2p_daemon")

#: How long one reservation attempt (connect, HOP RESERVE and its answer) may take, in seconds.
RESERVE_TIMEOUT_S = 15.0


def wants_reservation(mode: str, addrs: Sequence[str]) -> bool:
    """Whether to reserve relay slots: ``always``; ``off`` never; ``auto`` when none of this host's listen addresses
    (``/ip4|ip6/<ip>/...`` strings, wildcards already expanded) is a public IP and one is not loopback: a host on a
    LAN behind a router, which others cannot dial (p2pd learns that from AutoNAT, which py-libp2p lacks). Loopback
    only (tests, the local demo) reserves nothing. Raises ValueError for an unknown mode."""
    if mode not in RELAY_MODES:
        raise ValueError(f"relay must be one of {RELAY_MODES}, got {mode!r}")
    if mode != "auto":
        return mode == "always"
    ips = []
    for addr in addrs:
        parts = str(addr).split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            try:
                ips.append(ipaddress.ip_address(parts[2]))
            except ValueError:
                continue
    if any(ip.is_global for ip in ips):
        return False
    return any(not ip.is_loopback and not ip.is_unspecified for ip in ips)


def concrete_addrs(listen: Sequence[str], peers: Sequence[str]) -> list[str]:
    """``listen`` addresses with wildcards (``0.0.0.0``, ``::``) replaced by the local IPs this host reaches
    ``peers`` from (full multiaddrs; the kernel's route lookup of a UDP ``connect``, which sends nothing): py-libp2p
    reports a wildcard listener as such, and :func:`wants_reservation` needs IPs."""
    out = [a for a in listen if "/ip4/0.0.0.0/" not in f"{a}/" and "/ip6/::/" not in f"{a}/"]
    if len(out) == len(listen):
        return out
    for peer in peers:
        parts = str(peer).split("/")
        if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
            continue
        family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((parts[2], 9))
                out.append(f"/{parts[1]}/{probe.getsockname()[0]}")
        except OSError:
            continue
    return out


def circuit_addr(relay_maddr: str) -> str:
    """Our address through ``relay_maddr`` (``/ip4/.../tcp/N/p2p/<relay>``): ``/ip4/.../tcp/N/p2p/<relay>/p2p-circuit``
    (peers append ``/p2p/<our PeerID>``)."""
    return f"{relay_maddr.rstrip('/')}/p2p-circuit"


async def reserve_on_relays(host: Any, relays: Sequence[str], nursery: trio.Nursery, circuits: list[str]) -> None:
    """Answer relayed connections (and upgrade them to direct ones through DCUtR where possible) and reserve a slot
    on each of ``relays`` (full multiaddrs with ``/p2p/``), one after the other, each within
    :data:`RESERVE_TIMEOUT_S`; append the circuit address of each reservation made to ``circuits`` (the daemon
    announces them). A relay that refuses or cannot be reached is logged and skipped. The reservations are refreshed
    before they expire (py-libp2p's transport, in ``nursery``) for as long as ``nursery`` runs. The daemon runs this
    in the background: it serves its client meanwhile."""
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.relay.circuit_v2 import PROTOCOL_ID, CircuitV2Protocol, CircuitV2Transport, DCUtRProtocol
    from libp2p.relay.circuit_v2.config import RelayConfig
    from libp2p.tools.anyio_service import background_trio_service

    protocol = CircuitV2Protocol(host, allow_hop=False)  # answers STOP: relayed connections are upgraded as direct ones
    transport = CircuitV2Transport(host, protocol, RelayConfig())

    async def serve_stop(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        # DCUtR: a peer that reached us through the relay gets a direct connection where one can be made (we dial
        # it: "connection reversal", or both dial at once: hole punching)
        async with background_trio_service(protocol), background_trio_service(DCUtRProtocol(host)):
            task_status.started()
            await trio.sleep_forever()

    await nursery.start(serve_stop)
    for relay in relays:
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(relay))
            with trio.fail_after(RESERVE_TIMEOUT_S):
                await host.connect(info)
                stream = await host.new_stream(info.peer_id, [PROTOCOL_ID])
                reserved = await transport.reserve(stream, info.peer_id, nursery)
        except Exception as e:  # boundary: one relay (a nursery task); another may do, none leaves us dial-only
            logger.warning("no relay reservation on %s: %s", relay, e)
            continue
        if reserved:
            circuits.append(circuit_addr(relay))
            logger.info("relay reservation on %s: reachable at %s", relay, circuits[-1])
        else:
            logger.warning("relay %s refused a reservation", relay)
