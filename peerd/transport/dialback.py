"""Dialing a peer back on a fresh connection, and running the reachability check of :mod:`protocols.reachability`.

A daemon is already connected to the peer that asks it (the request came over that connection), so dialing through
the daemon's own libp2p node would reuse it and prove nothing. :func:`p2pd_dial` starts a throw-away p2pd with a
new random identity that does not listen and shares no connection with anyone, asks it to connect to the asking
PeerID at each address in turn (libp2p's handshake checks that the remote key is that PeerID) and stops it: about
one second of CPU per check, which the service's rate limits bound. Where p2pd cannot run (py-libp2p peers on
machines without the binary), :func:`tcp_dial` opens a TCP connection and completes libp2p's multistream-select
greeting (``/multistream/1.0.0``): proof that a libp2p node answers there, though not which one.

:func:`observed_addr` tells the service where a request came from: the remote address of the stream it arrived on,
which the p2pd stream handlers record (:class:`peerd.transport.hivemind_backend.HivemindStreams`).

**Relays.** A peer found not reachable waits (:data:`RELAY_WAIT_S`) for p2pd's auto-relay to reserve a slot and
announce a ``/p2p-circuit`` address; the verdict then names the relay ("not directly reachable; reachable through
relay X"). What that takes on a real network (go-libp2p v0.32, the version in hivemind's p2pd):

- the relays are the NATed peer's initial peers (the bootstrap nodes), which p2pd gets as static relays
  (:func:`peerd.transport.hivemind_backend.relay_options`); both sides run with ``relay = "auto"`` (or
  ``always`` on the NATed one);
- the relays have *public* IP addresses as go-multiaddr's ``manet.IsPublicAddr`` defines them (not 10/8,
  172.16/12, 192.168/16, 100.64/10, 127/8, 169.254/16, nor the TEST-NETs and other unroutable ranges): go-libp2p's
  AutoNAT dials back only public addresses and asks only peers that have them (so a peer among private addresses
  never learns it is private and never looks for a relay), a relay lists only its public addresses in a
  reservation, and auto-relay builds circuit addresses only from a relay's public ones;
- a relay carries more than 128 KiB per direction per circuit only once its own AutoNAT finds it public (p2pd's
  always-on relay has go-libp2p's default limits; the one with peerd's limits starts on "public"), which needs a
  peer at another public address to probe it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Awaitable, Callable, Optional, Sequence

from peerd.transport.p2pd_errors import P2PD_ERRORS
from protocols.reachability import ASK_TIMEOUT_S, DialBackService, Verdict, check_reachability, relays_of

logger = logging.getLogger(__name__)

MULTISTREAM = b"/multistream/1.0.0\n"


async def p2pd_dial(peer_id: str, addrs: Sequence[str], timeout_s: float) -> dict[str, tuple[bool, str]]:
    """``{addr: (ok, why)}``: a fresh p2pd (new identity, not listening, no relays, no NAT mapping) connects to
    ``peer_id`` at ``addrs`` one after another, each within ``timeout_s`` seconds, until one answers (the rest are
    reported not dialed: once connected, p2pd also dials the addresses the peer announced to it, so a later result
    would not be that address's own)."""
    from hivemind.p2p import P2P, PeerID
    from multiaddr import Multiaddr

    target = PeerID.from_base58(peer_id)
    prober = await P2P.create(host_maddrs=[], no_listen=True, nat_port_map=False, use_relay=False,
                              use_auto_relay=False, auto_nat=False, check_if_identity_free=False,
                              startup_timeout=max(15.0, timeout_s))
    out: dict[str, tuple[bool, str]] = {}
    try:
        for addr in addrs:
            reached = next((a for a, (ok, _) in out.items() if ok), None)
            if reached is not None:  # p2pd now knows the addresses the peer told it: a later dial proves nothing
                out[addr] = (False, f"not dialed: already reached at {reached}")
                continue
            started = time.monotonic()
            try:
                await asyncio.wait_for(prober._client.connect(target, [Multiaddr(addr)]), timeout_s)
            except asyncio.TimeoutError:
                out[addr] = (False, f"no answer within {timeout_s:.0f} s")
                continue
            except P2PD_ERRORS as e:  # p2pd reports every dial failure as a control error
                out[addr] = (False, f"dial failed: {str(e)[:150]}")
                continue
            out[addr] = (True, f"connected in {time.monotonic() - started:.2f} s")
    finally:
        await prober.shutdown()  # SIGTERM to its p2pd, then its exit: never raises
    return out


async def tcp_dial(peer_id: str, addrs: Sequence[str], timeout_s: float) -> dict[str, tuple[bool, str]]:
    """``{addr: (ok, why)}``: a TCP connection to each of ``addrs`` that answers libp2p's multistream-select
    greeting within ``timeout_s`` (does not verify ``peer_id``)."""
    from protocols.reachability import parse_tcp

    out: dict[str, tuple[bool, str]] = {}
    for addr in addrs:
        tcp = parse_tcp(addr)
        if tcp is None:
            out[addr] = (False, "not a TCP address")
            continue
        writer = None
        try:
            async def greet() -> bytes:
                nonlocal writer
                reader, writer = await asyncio.open_connection(tcp.host, tcp.port)
                writer.write(bytes([len(MULTISTREAM)]) + MULTISTREAM)
                await writer.drain()
                return await reader.readexactly(1 + len(MULTISTREAM))

            answer = await asyncio.wait_for(greet(), timeout_s)
        except asyncio.TimeoutError:
            out[addr] = (False, f"no answer within {timeout_s:.0f} s")
        except (OSError, asyncio.IncompleteReadError) as e:
            out[addr] = (False, f"dial failed: {e}")
        else:
            ok = answer[1:] == MULTISTREAM
            out[addr] = (ok, "a libp2p node answered" if ok else "something else answered")
        finally:
            if writer is not None:
                writer.close()
    return out


def default_dial():
    """:func:`p2pd_dial` where the p2pd binary runs here, else :func:`tcp_dial`."""
    from peerd.transport.libp2p_backend import p2pd_problem

    return p2pd_dial if p2pd_problem() is None else tcp_dial


def observed_addr(transport: Any, peer: str) -> Optional[str]:
    """The remote multiaddr of the last stream ``peer`` opened to us, where the transport records it (else None)."""
    streams = transport.streams
    for _ in range(4):  # wrappers (pacing, admission, the direct data plane) keep the p2p streams inside
        observed = getattr(streams, "observed", None)
        if isinstance(observed, dict):
            return observed.get(peer)
        streams = getattr(streams, "_inner", None) or getattr(streams, "inner", None)
        if streams is None:
            return None
    return None


def dialback_service(transport: Any, dial=None, on_bad_peer=None) -> DialBackService:
    """A (not yet started) dial-back service for ``transport``'s peers (start it with ``await s.start(transport)``)."""
    return DialBackService(dial or default_dial(), observed=lambda peer: observed_addr(transport, peer),
                           on_bad_peer=on_bad_peer)


def peer_of(maddr: str) -> Optional[str]:
    """The PeerID at the end of ``maddr`` (``.../p2p/<PeerID>``), else None."""
    parts = maddr.rstrip("/").split("/")
    return parts[-1] if len(parts) >= 2 and parts[-2] in ("p2p", "ipfs") else None


def announced_addrs(transport: Any, announce_maddrs: Sequence[str] = ()) -> list[str]:
    """What we ask helpers to dial: the configured ``announce_maddrs``, else the addresses we are visible at."""
    addrs = list(announce_maddrs) or list(transport.visible_maddrs())
    return [a for a in dict.fromkeys(addrs)]


#: How long the check waits for a relay reservation once it found this peer not reachable, in seconds: go-libp2p
#: reserves a slot only after its AutoNAT found the peer private (its first probe: ~15 s after start).
RELAY_WAIT_S = 30.0


async def visible_addrs(transport: Any) -> list[str]:
    """This peer's current addresses as p2pd announces them (a relay reservation adds a ``/p2p-circuit`` one)."""
    p2p = getattr(transport.streams, "p2p", None)
    if p2p is not None:
        return [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
    return list(transport.visible_maddrs())


async def check_transport(transport: Any, helpers: Sequence[str], announce_maddrs: Sequence[str] = (),
                          relay: str = "auto", timeout_s: float = ASK_TIMEOUT_S,
                          relay_wait_s: float = RELAY_WAIT_S) -> Verdict:
    """The dial-back verdict for this peer, asking ``helpers`` (PeerIDs; duplicates and ourselves skipped). A peer
    found not reachable with ``relay`` on waits up to ``relay_wait_s`` for a relay reservation, so the verdict can
    say which relay others reach it through."""
    helpers = [h for h in dict.fromkeys(helpers) if h and h != transport.streams.peer_id]
    verdict = await check_reachability(transport, helpers, announced_addrs(transport, announce_maddrs),
                                       timeout_s=timeout_s)
    verdict.relay_mode = relay
    deadline = time.monotonic() + (relay_wait_s if verdict.reachable is False and relay != "off" else 0.0)
    while True:
        with contextlib.suppress(*P2PD_ERRORS):  # p2pd did not answer now: asked again within a second
            verdict.relays = relays_of(await visible_addrs(transport))
        if verdict.relayed or time.monotonic() >= deadline:
            return verdict
        await asyncio.sleep(1.0)


#: The run's peers worth asking, read on each check (shuffled by the caller's reader), e.g.
#: :func:`peerd.status.records.dialable_peers`: transport knows no status records.
LivePeers = Callable[[], Awaitable[Sequence[str]]]


async def helpers_for(node: Any, live_peers: Optional[LivePeers] = None) -> list[str]:
    """Whom to ask: the PeerIDs of the node config's initial peers (bootstrap nodes are reachable by design), then
    what ``live_peers()`` returns (the run's peers that did not find themselves unreachable: a peer behind a NAT or
    firewall may fail to dial an address that others reach; it once told a reachable peer it was not)."""
    helpers = [p for p in map(peer_of, node.initial_peers) if p]
    if live_peers is not None:
        with contextlib.suppress(ConnectionError):  # the DHT unreachable now: only the initial peers are asked
            helpers += list(await live_peers())
    return list(dict.fromkeys(helpers))


def log_verdict(verdict: Verdict) -> None:
    """The one line a volunteer reads (a warning when others cannot dial this peer)."""
    level = logging.WARNING if verdict.reachable is False else logging.INFO
    logger.log(level, "%s", verdict.line(), extra={"event": "reachability", "reachable": verdict.reachable,
                                                   "address": verdict.address, "relayed": verdict.relayed,
                                                   "relays": verdict.relays})


#: Seconds before each new check while nobody answered: soon at first (a helper answers one check at a time, and
#: every peer of a swarm that starts together asks the same bootstrap node), then seldom.
RECHECK_S = (5.0, 15.0, 60.0, 60.0)


async def watch_reachability(transport: Any, node: Any, live_peers: Optional[LivePeers] = None, on_verdict=None,
                             recheck_s: Sequence[float] = RECHECK_S) -> Optional[Verdict]:
    """Run the check after joining and log its line; while nobody answered, check again after each delay of
    ``recheck_s`` (seconds) in turn. ``on_verdict(verdict)`` gets each verdict (the status board records
    ``reachable``)."""
    verdict = None
    for attempt in range(len(recheck_s) + 1):
        helpers = await helpers_for(node, live_peers)
        verdict = await check_transport(transport, helpers, node.announce_maddrs, node.relay)
        if on_verdict is not None:
            on_verdict(verdict)
        if verdict.reachable is not None or attempt == len(recheck_s):
            log_verdict(verdict)
            return verdict
        if attempt == 0:
            log_verdict(verdict)
        await asyncio.sleep(recheck_s[attempt])
    return verdict


def listens_on_loopback_only(host_maddrs: Sequence[str]) -> bool:
    """True if every listen address is a loopback IP (nobody on another machine can dial us)."""
    import ipaddress

    hosts = []
    for maddr in host_maddrs:
        parts = maddr.split("/")
        if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
            return False
        hosts.append(parts[2])
    try:
        return bool(hosts) and all(ipaddress.ip_address(h).is_loopback for h in hosts)
    except ValueError:
        return False
