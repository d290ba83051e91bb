"""Can other peers dial this one? A "dial me back" check between peers, and the verdict a volunteer reads.

A peer that wants to know asks a few other peers (service :data:`SERVICE`, method ``dialback``) to open a *fresh*
connection to the addresses it announces and to say which ones answered, as the Petals health monitor does and as
libp2p's AutoNAT (github.com/libp2p/specs/blob/master/autonat/autonat-v1.md) specifies: a peer behind a NAT
without a forwarded port has no address that answers.

**Not a traffic amplifier.** The helper dials only the asking peer: an address naming another PeerID is skipped
(and the dialer checks the PeerID in the libp2p handshake); only plain TCP addresses (``/ip4`` or ``/ip6`` +
``/tcp``), never DNS names or relay circuits; where the helper knows the address the request came from (the
"observed" address), only addresses on that IP, plus that IP with each announced port (how a volunteer learns the
public address to announce, as in AutoNAT); at most :data:`MAX_DIALS` addresses, each with a time limit; at most one
check per asking peer per ``per_peer_interval_s`` and :data:`GLOBAL_PER_MINUTE` in all, one at a time.

**Wire.** Request header ``{"addrs": [<multiaddr>, ...]}`` (at most :data:`MAX_REQUEST_ADDRS` strings of at most
:data:`MAX_ADDR_CHARS` characters). Answer header ``{"observed": <multiaddr or None>, "results": [{"addr": str,
"ok": bool, "why": str}, ...]}``: one entry per address dialed or skipped. A malformed request is a protocol
violation: the asker is reported (``on_bad_peer``, the daemon bans it) and refused. A busy helper refuses with code
``busy``.

Pure decision logic (:func:`plan_dials`, :class:`DialLimiter`, :func:`verdict_of`) plus the service and the asking
side on :mod:`protocols.rpc`; how an address is dialed is the transport's business (``dial`` is injected).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

from protocols.bans import BanList
from protocols.rpc import Refused, Request, RpcError, Service, call
from protocols.wire import ProtocolViolation

logger = logging.getLogger(__name__)

#: Service name (run-independent: reachability is a property of the machine, not of a run).
SERVICE = "peerd.reach"
#: Most addresses a request may list; more is a protocol violation.
MAX_REQUEST_ADDRS = 16
#: Longest address text a request may hold.
MAX_ADDR_CHARS = 256
#: Most addresses one check dials.
MAX_DIALS = 4
#: Time limit of one dial, in seconds.
DIAL_TIMEOUT_S = 5.0
#: Time a dialer may take to start (a fresh libp2p node), in seconds, on top of its dials.
DIALER_START_S = 20.0
#: How long an asking peer waits for a helper's answer, in seconds.
ASK_TIMEOUT_S = DIAL_TIMEOUT_S * MAX_DIALS + DIALER_START_S + 5.0
#: Checks a helper runs per minute, for all askers together.
GLOBAL_PER_MINUTE = 12
#: Seconds between two checks for the same asking peer.
PER_PEER_INTERVAL_S = 30.0

#: ``dial(peer_id, addrs, timeout_s) -> {addr: (ok, why)}``: open a fresh connection to ``peer_id`` at each address.
Dial = Callable[[str, Sequence[str], float], Awaitable[dict[str, tuple[bool, str]]]]


@dataclass(frozen=True)
class TcpAddr:
    """A direct TCP multiaddr, split: ``family`` ("ip4" or "ip6"), ``host``, ``port``, ``peer_id`` (or None)."""

    family: str
    host: str
    port: int
    peer_id: Optional[str] = None

    def text(self, with_peer: bool = True) -> str:
        tail = f"/p2p/{self.peer_id}" if with_peer and self.peer_id else ""
        return f"/{self.family}/{self.host}/tcp/{self.port}{tail}"


def parse_tcp(maddr: str) -> Optional[TcpAddr]:
    """``/ip4|ip6/<ip>/tcp/<port>[/p2p/<PeerID>]`` split into a :class:`TcpAddr`; None for any other multiaddr
    (DNS names, relay circuits, QUIC, malformed)."""
    parts = maddr.split("/")
    if len(parts) not in (5, 7) or parts[0] != "" or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
        port = int(parts[4])
    except ValueError:
        return None
    if (ip.version == 4) != (parts[1] == "ip4") or not 0 < port < 65536 or not parts[4].isdigit():
        return None
    peer_id = None
    if len(parts) == 7:
        if parts[5] != "p2p" or not parts[6]:
            return None
        peer_id = parts[6]
    return TcpAddr(parts[1], str(ip), port, peer_id)


def check_request(header: dict[str, Any]) -> list[str]:
    """The request's address list. Raises ProtocolViolation if it is not a list of at most MAX_REQUEST_ADDRS
    strings of 1-MAX_ADDR_CHARS characters."""
    addrs = header.get("addrs")
    if not isinstance(addrs, list) or len(addrs) > MAX_REQUEST_ADDRS:
        raise ProtocolViolation(f"'addrs' must be a list of at most {MAX_REQUEST_ADDRS} multiaddrs")
    for addr in addrs:
        if not isinstance(addr, str) or not 0 < len(addr) <= MAX_ADDR_CHARS:
            raise ProtocolViolation(f"'addrs' must hold strings of 1-{MAX_ADDR_CHARS} characters")
    return addrs


def plan_dials(asker: str, addrs: Sequence[str], observed: Optional[str],
               max_dials: int = MAX_DIALS) -> tuple[list[str], list[tuple[str, str]]]:
    """Which of ``addrs`` a helper dials for ``asker`` (rules in the module docstring): ``(to_dial, skipped)``,
    ``to_dial`` as ``/ipX/<ip>/tcp/<port>`` without the PeerID, ``skipped`` as ``(addr, why)``. ``observed``: the
    multiaddr the request came from, None if unknown (then the announced addresses are dialed as given)."""
    seen_ip = parse_tcp(observed) if observed else None
    to_dial: list[str] = []
    skipped: list[tuple[str, str]] = []
    ports: list[int] = []

    def add(candidate: str) -> None:
        if candidate not in to_dial:
            if len(to_dial) < max_dials:
                to_dial.append(candidate)
            else:
                skipped.append((candidate, f"over the limit of {max_dials} dials"))

    for addr in addrs:
        tcp = parse_tcp(addr)
        if tcp is None:
            skipped.append((addr, "not a direct TCP address (/ip4 or /ip6 + /tcp)"))
            continue
        if tcp.peer_id is not None and tcp.peer_id != asker:
            skipped.append((addr, "names another peer"))
            continue
        if tcp.port not in ports:
            ports.append(tcp.port)
        if seen_ip is not None and tcp.host != seen_ip.host:
            skipped.append((addr, f"not the IP the request came from ({seen_ip.host})"))
            continue
        add(tcp.text(with_peer=False))
    if seen_ip is not None:  # the public side of a NAT: does a forwarded port answer there?
        for port in ports:
            add(TcpAddr(seen_ip.family, seen_ip.host, port).text())
    return to_dial, skipped


class DialLimiter:
    """At most one check per asking peer per ``per_peer_interval_s`` and ``per_minute`` checks in all (sliding
    minute). ``clock``: monotonic seconds, injectable for tests."""

    def __init__(self, per_peer_interval_s: float = PER_PEER_INTERVAL_S, per_minute: int = GLOBAL_PER_MINUTE,
                 clock: Callable[[], float] = time.monotonic, max_tracked: int = 4096):
        self.per_peer_interval_s = per_peer_interval_s
        self.per_minute = per_minute
        self.clock = clock
        self.max_tracked = max_tracked
        self._last: dict[str, float] = {}
        self._recent: list[float] = []

    def admit(self, peer: str) -> Optional[str]:
        """None and the check counted, or why ``peer`` must wait."""
        now = self.clock()
        self._recent = [t for t in self._recent if now - t < 60.0]
        last = self._last.get(peer)
        if last is not None and now - last < self.per_peer_interval_s:
            return f"one check per {self.per_peer_interval_s:.0f} s per peer; retry in {last + self.per_peer_interval_s - now:.0f} s"
        if len(self._recent) >= self.per_minute:
            return f"this peer runs at most {self.per_minute} checks a minute"
        if len(self._last) >= self.max_tracked:  # bounded memory: forget the peers whose interval has passed
            self._last = {p: t for p, t in self._last.items() if now - t < self.per_peer_interval_s}
        self._last[peer] = now
        self._recent.append(now)
        return None


class DialBackService(Service):
    """Serves ``dialback``: dials the asking peer back at the addresses it announces (bounded, rate-limited).

    Args:
        dial: opens fresh connections (see :data:`Dial`).
        observed: ``observed(peer) -> multiaddr or None``, the address ``peer``'s request came from.
        on_bad_peer: ``on_bad_peer(peer, reason)`` for a malformed request (the daemon logs or counts it).
        bans: where a peer that sent a malformed request is banned (its later requests are refused with code
            ``banned`` until the ban expires); default: a list of this service's own.
    """

    name = SERVICE
    request_timeout_s = 10.0

    def __init__(self, dial: Dial, observed: Callable[[str], Optional[str]] = lambda peer: None,
                 on_bad_peer: Optional[Callable[[str, str], None]] = None, limiter: Optional[DialLimiter] = None,
                 dial_timeout_s: float = DIAL_TIMEOUT_S, max_dials: int = MAX_DIALS,
                 bans: Optional[BanList] = None):
        self.dial = dial
        self.bans = bans if bans is not None else BanList()
        self.observed = observed
        self.on_bad_peer = on_bad_peer
        self.limiter = limiter or DialLimiter()
        self.dial_timeout_s = dial_timeout_s
        self.max_dials = max_dials
        self._one_at_a_time = asyncio.Lock()
        self.checks = 0

    def on_bad_request(self, peer: str, method: str, error: RpcError) -> None:
        logger.warning("malformed dial-back request from %s: %s", peer, error)
        self.bans.ban(peer, f"malformed dial-back request: {error}")
        if self.on_bad_peer is not None:
            self.on_bad_peer(peer, f"malformed dial-back request: {error}")

    async def rpc_dialback(self, request: Request) -> dict[str, Any]:
        peer = request.peer
        if self.bans.is_banned(peer):
            raise Refused(f"banned: {self.bans.reason(peer)}", "banned")
        try:
            addrs = check_request(request.header)
        except ProtocolViolation as e:
            self.on_bad_request(peer, "dialback", e)
            raise Refused(str(e), "bad_request") from None
        if self._one_at_a_time.locked():
            raise Refused("another dial-back check is running", "busy")
        why = self.limiter.admit(peer)
        if why is not None:
            raise Refused(why, "busy")
        async with self._one_at_a_time:
            observed = self.observed(peer)
            to_dial, skipped = plan_dials(peer, addrs, observed, self.max_dials)
            dialed: dict[str, tuple[bool, str]] = {}
            if to_dial:
                try:
                    dialed = await asyncio.wait_for(self.dial(peer, to_dial, self.dial_timeout_s),
                                                    self.dial_timeout_s * len(to_dial) + DIALER_START_S)
                except Exception as e:  # noqa: BLE001 - boundary: the host's dialer (any transport's code); its
                    # failure is this check's answer (every address failed), not a crash of the service
                    dialed = {a: (False, f"dialer failed: {type(e).__name__}: {e}") for a in to_dial}
            self.checks += 1
        results = [{"addr": a, "ok": bool(dialed.get(a, (False, ""))[0]),
                    "why": str(dialed.get(a, (False, "not dialed"))[1])[:200]} for a in to_dial]
        results += [{"addr": a, "ok": False, "why": why} for a, why in skipped]
        return {"observed": observed, "results": results}


# ------------------------------------------------------------------------------------------------ the asking side


@dataclass
class DialBackAnswer:
    """One helper's answer: the address it saw us come from and, per address, whether its dial succeeded."""

    helper: str
    observed: Optional[str]
    results: list[tuple[str, bool, str]]


class BadAnswer(Exception):
    """A helper's answer does not follow the protocol."""


def parse_answer(helper: str, header: dict[str, Any]) -> DialBackAnswer:
    """A helper's answer header, checked. Raises BadAnswer if malformed."""
    observed = header.get("observed")
    results = header.get("results")
    if observed is not None and not (isinstance(observed, str) and len(observed) <= MAX_ADDR_CHARS):
        raise BadAnswer("'observed' is not a multiaddr")
    if not isinstance(results, list) or len(results) > MAX_REQUEST_ADDRS + MAX_DIALS:
        raise BadAnswer("'results' is not a short list")
    out = []
    for entry in results:
        if not (isinstance(entry, dict) and isinstance(entry.get("addr"), str) and isinstance(entry.get("ok"), bool)
                and isinstance(entry.get("why", ""), str)):
            raise BadAnswer("a result is not {addr, ok, why}")
        out.append((entry["addr"][:MAX_ADDR_CHARS], entry["ok"], entry.get("why", "")[:200]))
    return DialBackAnswer(helper, observed, out)


async def ask_dialback(transport: Any, helper: str, addrs: Sequence[str], timeout_s: float = ASK_TIMEOUT_S) -> DialBackAnswer:
    """Ask ``helper`` to dial us back at ``addrs``. Raises RpcError (unreachable, refused: e.g. ``busy``) or
    BadAnswer."""
    reply = await call(transport.streams, helper, SERVICE, "dialback", {"addrs": list(addrs)[:MAX_REQUEST_ADDRS]},
                       timeout_s=timeout_s, max_reply_bytes=64 << 10)
    return parse_answer(helper, reply.header)


@dataclass
class Verdict:
    """What the dial-back check found: ``reachable`` True/False, or None if no helper answered.

    ``address``: an address that answered; ``public_ip``: the IP helpers saw us come from; ``ports``: the TCP ports
    we announce; ``helpers``: PeerIDs that answered; ``relayed``: this peer holds a circuit relay reservation (it
    announces a ``/p2p-circuit`` address); ``relays``: the relays' addresses (:func:`relays_of`)."""

    reachable: Optional[bool]
    address: Optional[str] = None
    public_ip: Optional[str] = None
    ports: list[int] = field(default_factory=list)
    helpers: list[str] = field(default_factory=list)
    asked: int = 0
    relay_mode: str = "auto"
    relays: list[str] = field(default_factory=list)

    @property
    def relayed(self) -> bool:
        """Whether this peer holds a circuit relay reservation (it is reachable through ``relays``)."""
        return bool(self.relays)

    def line(self) -> str:
        """One line for a volunteer: what was found and what to do about it."""
        if self.reachable:
            return (f"reachable: other peers can dial this peer at {self.address} (checked by {len(self.helpers)} "
                    f"peer(s))")
        if self.reachable is None:
            return (f"reachability unknown: none of the {self.asked} peer(s) asked answered the dial-back check; "
                    "peerd doctor checks again")
        port = self.ports[0] if self.ports else None
        forward = f"forward TCP port {port} of your router to this machine" if port else \
            "listen on a fixed port (host_maddrs = [\"/ip4/0.0.0.0/tcp/31337\"]) and forward it on your router"
        announce = (f", then set announce_maddrs = [\"/ip4/{self.public_ip}/tcp/{port or 31337}\"]"
                    if self.public_ip and not _is_private(self.public_ip) else
                    ", then set announce_maddrs to your public address")
        if self.relayed:
            via = self.relays[0] if self.relays else "a circuit relay"
            more = f" (and {len(self.relays) - 1} more)" if len(self.relays) > 1 else ""
            return (f"not directly reachable; reachable through relay {via}{more} (slower: every byte passes the "
                    f"relay); for direct connections {forward}{announce}")
        if self.relay_mode == "off":
            now = "or set relay = \"auto\" to be reached through relays"
        else:
            now = "until then this peer only dials out (relay = \"auto\" may get it a relay slot)"
        return f"not reachable: no peer could dial this peer back; {forward}{announce}; {now}"


def relays_of(addrs: Sequence[str]) -> list[str]:
    """The relays this peer is reachable through: of each circuit address in ``addrs``
    (``<relay addr>/p2p/<relay PeerID>/p2p-circuit[/p2p/<our PeerID>]``), the part before ``/p2p-circuit``; in
    order, without duplicates."""
    out = []
    for addr in addrs:
        head, sep, _ = addr.partition("/p2p-circuit")
        if sep and head and head not in out:
            out.append(head)
    return out


def _is_private(ip: str) -> bool:
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return True
    return not address.is_global


def verdict_of(answers: Sequence[DialBackAnswer], asked: int, announced: Sequence[str]) -> Verdict:
    """The verdict of the helpers' ``answers`` (``asked``: how many helpers were asked; ``announced``: the
    addresses we asked them to dial): reachable if any helper reached any address (the first such address is
    named), not reachable if helpers answered and none did, unknown (None) if none answered."""
    ports = []
    for addr in announced:
        tcp = parse_tcp(addr)
        if tcp is not None and tcp.port not in ports:
            ports.append(tcp.port)
    public_ip = next((tcp.host for tcp in (parse_tcp(a.observed or "") for a in answers) if tcp is not None), None)
    helpers = [a.helper for a in answers]
    for answer in answers:
        for addr, ok, _ in answer.results:
            if ok:
                return Verdict(True, addr, public_ip, ports, helpers, asked)
    if not answers:
        return Verdict(None, None, None, ports, [], asked)
    return Verdict(False, None, public_ip, ports, helpers, asked)


async def check_reachability(transport: Any, helpers: Sequence[str], announced: Sequence[str], want: int = 2,
                             timeout_s: float = ASK_TIMEOUT_S) -> Verdict:
    """Ask ``helpers`` in order, one after another, until ``want`` answered (one that reached us is enough), and
    return :func:`verdict_of` their answers. A helper that fails, refuses or answers garbage is skipped (logged)."""
    answers: list[DialBackAnswer] = []
    asked = 0
    for helper in helpers:
        if helper == transport.streams.peer_id:
            continue
        asked += 1
        try:
            answer = await ask_dialback(transport, helper, announced, timeout_s)
        except (RpcError, BadAnswer) as e:
            logger.info("dial-back check by %s: %s", helper, e)
            continue
        answers.append(answer)
        if len(answers) >= want or any(ok for _, ok, _ in answer.results):
            break
    return verdict_of(answers, asked, announced)
