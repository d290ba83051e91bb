"""The matchmaking runner: :class:`Matchmaker`, a service that leads or joins the group of a key (see
:mod:`protocols.matchmaking`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional, Sequence

from protocols.bans import BanList
from protocols.interfaces import Transport
from protocols.matchmaking.config import (
    AdmissionRefused, AdmitFn, Group, MatchmakingConfig, MatchmakingFailed, SealedWithout,
)
from protocols.matchmaking.session import (
    _awaited, _deadline, _Follower, _group_answer, _Late, _rank, _rival_key, _seal_at, _Session,
)
from protocols.rpc import Refused, Request, RpcError, RpcTimeout, Service, Unreachable, call
from protocols.wire import ProtocolViolation, require

logger = logging.getLogger("protocols.matchmaking")

#: A deadline this close counts as reached: asyncio runs a timer up to its clock resolution (1 ns) early, so a wait
#: for the last few ns could wake without the clock moving, and on a virtual clock never move it (a busy loop).
_DUE_S = 1e-6

#: Attempts to reach a leader that failed before a redirect to it no longer makes us try it again.
_RETRIES = 2

#: Probes in a row that a missing expected member leaves unanswered before its group stops waiting for it.
_PROBE_FAILURES = 2

#: The key of a probe: a join request for it is answered ``{"type": "alive", "keys": [...]}`` by every live
#: matchmaker (the keys it is matchmaking for or sealed lately); matchmakers before that answer refused it ("gone").
_PROBE_KEY = "probe.alive"

#: Most keys a probe's answer lists (a matchmaker remembers the last 64 sealed keys, plus its open sessions).
_PROBE_MAX_KEYS = 128

#: Most PeerIDs a join request may list as expected (``expects``); a longer list is a malformed request.
_MAX_EXPECTS = 10_000


class Matchmaker(Service):
    """Forms averaging groups among peers that share a discovery prefix.

    An RPC service (:mod:`protocols.rpc`) named ``prefix`` with one method, ``join`` (stream handler
    ``<prefix>.join``): the request is ``{key, info, remaining_s}`` and optionally ``expects`` (the PeerIDs the
    joining peer expects in the group, at most 10,000); the leader answers when the group is sealed
    (``{"type": "group", group_id, members, infos}``) or it defers (``{"type": "redirect", leader}``), or refuses
    with code ``refused`` (admission), ``late`` (already sealed) or ``gone`` (not matchmaking for that key). A
    request for the probe key ``probe.alive`` is answered ``{"type": "alive", "keys": [...]}``: the keys this peer is
    matchmaking for or sealed lately (a leader waiting for a missing member asks where it is).
    ``remaining_s`` is how long the joining peer can still wait in all; a member of a sealed group asking again
    (its answer was lost in a redirect race) gets the sealed group.
    Call :meth:`start` once, then :meth:`form_group` once per round.
    """

    def __init__(
        self,
        transport: Transport,
        prefix: str,
        config: MatchmakingConfig,
        admit: Optional[AdmitFn] = None,
        bans: Optional[BanList] = None,
    ) -> None:
        self.transport = transport
        self.prefix = self.name = prefix
        self.config = config
        self.request_timeout_s = config.request_timeout_s
        self.admit = admit
        self.bans = bans if bans is not None else BanList()
        self._sessions: dict[str, _Session] = {}
        self._sealed_keys: OrderedDict[str, Optional[Group]] = OrderedDict()
        self._probers: set[asyncio.Task] = set()  # probes of missing members still in flight

    @property
    def peer_id(self) -> str:
        return self.transport.streams.peer_id

    @property
    def handler_name(self) -> str:
        return self.handler_name_of("join")

    def _own_rank(self, session: _Session) -> tuple[bool, str]:
        return session.info.get("dial_only") is True, self.peer_id

    def _discovery_key(self, key: str) -> str:
        return f"{self.prefix}.mm.{key}"

    async def form_group(self, key: str, info: dict[str, Any], expected_size: Optional[int] = None,
                         on_late: str = "fail", expected_members: Optional[Sequence[str]] = None,
                         round_prefix: Optional[str] = None, expected_peers: Optional[Iterable[str]] = None) -> Group:
        """Join or lead the group for ``key``; returns the sealed group.

        Args:
            key: group key shared by the peers that should average together (e.g. ``"round7"``).
            info: msgpack-serializable facts about this peer that every member receives (and the leader's ``admit``
                checks). ``"dial_only": True`` in it says this peer cannot be dialed directly (behind a NAT: reached
                through a relay, or not at all): its discovery record says so too, and peers that can be dialed lead
                before it (every follower dials its leader; a dial-only leader would pull each join through a relay,
                or fail it).
            expected_size: seal as soon as this many peers (this one included) have joined, but never with fewer
                than ``min_group_size`` (such a group would fail); None = wait until nobody new joins for
                ``matchmaking_timeout_s``.
            on_late: what to do when the group for ``key`` was sealed before we joined it: ``"fail"`` (raise
                MatchmakingFailed) or ``"next"`` (form the group of the peers that came late, under the key
                ``<key>.late<n>``, within the same ``max_wait_s``; the returned group's ``key`` says which).
            expected_members: the PeerIDs that should form this group (this peer is added), when known: the group
                seals as soon as all of them have joined, or when the earliest member's ``max_wait_s`` runs out
                (whoever has joined by then, peers outside the list included), never after an idle window;
                ``expected_size`` is then ignored. The next group of late peers (``on_late="next"``) expects nobody
                in particular and seals on the idle window.
            round_prefix: with ``expected_members``: the keys of the other groups of the same round start with it
                (Moshpit: ``moshpit.r<round>.``); a missing member found matchmaking under such a key (its view of
                the swarm gave it another group) is left out at the next probe instead of holding the group up to
                ``max_wait_s``.
            expected_peers: with ``expected_size``: the PeerIDs this peer believes are coming (its view of the swarm;
                at most 10,000). Views are pooled: a follower sends its own to the leader (``expects``), and the group
                seals early only once it has ``expected_size`` members *and* every peer that any member expects (or
                on the idle window, as without). A leader whose view lacks peers (status records missing from a
                loaded DHT) no longer seals before the peers its followers know of arrive.

        Raises:
            AdmissionRefused: the leader refused this peer.
            MatchmakingFailed: no group of at least ``min_group_size`` formed within ``max_wait_s``, or (with
                ``on_late="fail"``) the group was already sealed.
        """
        if on_late not in ("fail", "next"):
            raise ValueError(f"on_late must be 'fail' or 'next', got {on_late!r}")
        members = None if expected_members is None else frozenset(expected_members) | {self.peer_id}
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.config.max_wait
        for generation in range(64):
            attempt = key if generation == 0 else f"{key}.late{generation}"
            try:
                if generation == 0 and members is not None:
                    return await self._form_group(attempt, info, len(members), give_up, members, round_prefix)
                expects = None if generation or expected_peers is None else tuple(sorted(set(expected_peers)))
                return await self._form_group(attempt, info, expected_size, give_up, expects=expects)
            except _Late as e:
                if on_late == "fail":
                    raise SealedWithout(attempt, e.leader) from None
                logger.info("%s; joining the next group of late peers", e)
        raise MatchmakingFailed(f"no group formed for {key!r}: sealed 64 times before we joined")

    async def _form_group(self, key: str, info: dict[str, Any], expected_size: Optional[int], give_up: float,
                          expected_members: Optional[frozenset] = None, round_prefix: Optional[str] = None,
                          expects: Optional[tuple[str, ...]] = None) -> Group:
        if key in self._sessions:
            raise RuntimeError(f"already matchmaking for {key!r}")
        loop = asyncio.get_running_loop()
        cfg = self.config
        now = loop.time()
        if expects is not None and len(expects) > _MAX_EXPECTS:
            raise ValueError(f"expected_peers lists {len(expects)} peers, at most {_MAX_EXPECTS}")
        session = _Session(key, info, give_up, min(give_up, now + cfg.matchmaking_timeout_s), expected_size,
                           expected_members, expects, None if expects is None else set(expects), round_prefix)
        self._sessions[key] = session
        self._sealed_keys.pop(key, None)
        discovery = self.transport.discovery
        dkey = self._discovery_key(key)
        try:
            expiration = session.expiration = discovery.time() + (give_up - now) + cfg.request_timeout_s
            dial_only = self._own_rank(session)[0]
            joined = {"joined": discovery.time(), **({"dial_only": True} if dial_only else {})}
            await discovery.store(dkey, self.peer_id, joined, expiration)
            unreachable: set[str] = set()  # leaders we could not reach, and leaders that defer to one of those
            failures: dict[str, int] = {}  # failed attempts to reach each leader
            redirect: Optional[str] = None
            while loop.time() < session.deadline:
                if redirect is not None and redirect not in unreachable and not self.bans.is_banned(redirect):
                    leader = redirect
                else:
                    ranks = {p: _rank(p, record) for p, record in (await discovery.get(dkey)).items()}
                    ranks[self.peer_id] = self._own_rank(session)
                    eligible = [p for p in ranks.keys() - unreachable
                                if p == self.peer_id or not self.bans.is_banned(p)]
                    leader = min(eligible, key=ranks.__getitem__)
                redirect = None
                if leader == self.peer_id:
                    session.following = None
                    group = await self._lead(session, dkey, unreachable)
                    if group is not None:
                        self._remember_sealed(key, group)
                        self._announce_seal(session, dkey)
                        return group
                    redirect = session.following
                    if redirect in unreachable and failures.get(redirect, 0) < _RETRIES:
                        unreachable.discard(redirect)  # (a sealer we failed to reach once: see the redirect below)
                    continue
                session.following = leader
                self._hand_over(session, leader)
                kind, value = await self._follow(session, leader)
                if kind == "group":
                    self._remember_sealed(key, value)
                    return value
                if kind == "redirect":
                    redirect = value
                    if value in unreachable and failures.get(value, 0) < _RETRIES:
                        # ``leader`` reached that peer: our failed attempt may have been transient (a loaded
                        # leader that read our request late); before, we bounced between the two until max_wait_s
                        unreachable.discard(value)
                    elif value in unreachable or value == leader:
                        await asyncio.sleep(cfg.poll_interval_s)
                elif kind in ("unreachable", "gone"):
                    logger.debug("leader %s unreachable for %s: %s", leader, key, value)
                    unreachable.add(leader)
                    failures[leader] = failures.get(leader, 0) + 1
                elif kind == "refused":
                    raise AdmissionRefused(leader, value)
                elif kind == "late":
                    raise _Late(f"the group for {key!r} was already sealed by {leader}", leader)
            raise MatchmakingFailed(f"no group formed for {key!r} within max_wait_s={cfg.max_wait:g}")
        finally:
            del self._sessions[key]
            for follower in session.followers.values():
                if not follower.answer.done():
                    follower.answer.set_result(("unreachable", "leader stopped matchmaking"))

    def _announce_seal(self, session: _Session, dkey: str) -> None:
        """Mark our discovery record for the key as sealed, in the background (the seal must not wait for a store):
        a later arrival with a smaller PeerID would otherwise lead a group nobody comes to (see the module doc)."""
        discovery = self.transport.discovery
        # a later expiration: a store never replaces a record that lives longer
        stored = discovery.store(dkey, self.peer_id, {"joined": discovery.time(), "sealed": True},
                                 session.expiration + 1e-3)
        task = asyncio.ensure_future(stored)
        self._probers.add(task)
        task.add_done_callback(_forget(self._probers))

    def _remember_sealed(self, key: str, group: Optional[Group] = None) -> None:
        self._sealed_keys[key] = group
        while len(self._sealed_keys) > 64:
            self._sealed_keys.popitem(last=False)

    def _hand_over(self, session: _Session, leader: str) -> None:
        """Redirect everyone who joined us to ``leader``."""
        for follower in session.followers.values():
            if not follower.answer.done():
                follower.answer.set_result(("redirect", leader))
        session.followers.clear()

    async def _lead(self, session: _Session, dkey: str, unreachable: set[str]) -> Optional[Group]:
        """Collect followers until the group is complete or time is up; None if we deferred to a smaller peer."""
        stop = asyncio.Event()
        if session.expected_members is not None:
            # not cancelled at the seal but told to stop: a probe cancelled in flight can lose its answer's
            # exception inside wait_for ("Task exception was never retrieved"); a probe ends within matchmaking_timeout_s
            prober = asyncio.ensure_future(self._drop_absent_members(session, stop))
            self._probers.add(prober)
            prober.add_done_callback(self._probers.discard)
        try:
            return await self._collect(session, dkey, unreachable)
        finally:
            stop.set()

    async def _drop_absent_members(self, session: _Session, stop: asyncio.Event) -> None:
        """Leave expected members that will not come out of the group ``session`` leads, so that it seals without
        them.

        A known member that has not joined holds the group until ``max_wait_s`` (it may be on its way: previous
        rounds end spread out). But a member whose process died never comes, and waiting for it cost its whole
        group ``max_wait_s`` a round. So once the group has gained nobody for ``matchmaking_timeout_s``, every
        missing member is probed (a join request for the probe key: any answer, an older peer's refusal included,
        says the peer's matchmaker is alive), again after each further window; a member that does not answer
        ``_PROBE_FAILURES`` times in a row is dropped from the expected members, and so is one whose answer
        shows it matchmaking for another group of the round (``round_prefix``). A dropped member that was only
        slow finds the group sealed and joins the next group of late peers (``on_late="next"``).
        """
        loop = asyncio.get_running_loop()
        cfg = self.config
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.matchmaking_timeout_s)
            if stop.is_set():
                return
            if loop.time() < session.idle_until - _DUE_S:
                continue  # members are still arriving
            missing = sorted(session.expected_members - session.followers.keys() - {self.peer_id})
            answers = await asyncio.gather(*(self._probe(peer) for peer in missing))
            if stop.is_set():
                return
            dead, elsewhere = set(), {}
            for peer, keys in zip(missing, answers):
                session.probe_failures[peer] = 0 if keys is not None else session.probe_failures.get(peer, 0) + 1
                if session.probe_failures[peer] >= _PROBE_FAILURES and peer not in session.followers:
                    dead.add(peer)
                rival = _rival_key(session, keys or ())
                if rival is not None and peer not in session.followers:
                    elsewhere[peer] = rival
            if dead:
                logger.info("expected member(s) %s of %s did not answer %d probes: sealing without them",
                            sorted(dead), session.key, _PROBE_FAILURES)
            if elsewhere:
                logger.info("expected member(s) of %s matchmake for other groups of the round (their view of the "
                            "swarm differs): %s; sealing without them", session.key,
                            ", ".join(f"{peer} in {key}" for peer, key in sorted(elsewhere.items())))
            if dead or elsewhere:
                session.expected_members = session.expected_members - dead - elsewhere.keys()
                session.changed.set()

    async def _probe(self, peer: str) -> Optional[tuple[str, ...]]:
        """The keys ``peer`` is matchmaking for or sealed lately, () when it does not say (an older peer, or a
        malformed answer), None when its matchmaker does not answer within ``matchmaking_timeout_s`` (not the
        tighter ``request_timeout_s``: a live peer on a loaded machine can take longer than that to read a request,
        and a live member dropped by mistake averages in a late group)."""
        request = {"key": _PROBE_KEY, "info": {}, "remaining_s": 0.0}
        try:
            reply = await call(self.transport.streams, peer, self.prefix, "join", request,
                               timeout_s=self.config.matchmaking_timeout_s)
        except (Unreachable, RpcTimeout):
            return None
        except RpcError:  # refused ("gone": a matchmaker before the answer), or an answer that breaks the protocol
            return ()
        keys = reply.header.get("keys") if reply.header.get("type") == "alive" else None
        if not isinstance(keys, list) or len(keys) > _PROBE_MAX_KEYS or not all(isinstance(k, str) for k in keys):
            return ()
        return tuple(keys)

    async def _collect(self, session: _Session, dkey: str, unreachable: set[str]) -> Optional[Group]:
        loop = asyncio.get_running_loop()
        while True:
            for peer in [p for p, f in session.followers.items() if f.closed.is_set()]:
                logger.info("peer %s left matchmaking for %s before the seal", peer, session.key)
                del session.followers[peer]
            size = 1 + len(session.followers)
            if session.expected_members is not None:
                if session.expected_members <= session.followers.keys() | {self.peer_id}:
                    break
            elif (session.expected_size is not None and size >= max(session.expected_size, self.config.min_group_size)
                  and not _awaited(session, self.peer_id)):
                # a smaller group would fail every member's round: an expected size below the minimum comes from a
                # view missing some peers (a status record that lapsed under load), so wait for them instead; and
                # so does a peer that a follower's view has and ours lacks
                break
            remaining = _seal_at(session) - loop.time()
            if remaining <= _DUE_S:
                break
            session.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(session.changed.wait(), min(self.config.poll_interval_s, remaining))
            # at a follower's deadline the seal is due, and that follower gives up request_timeout_s later: neither
            # a slow discovery read (seconds, on a loaded DHT) nor a smaller peer found at the last moment may push
            # the seal past it (the followers ran out of time, the leader sealed alone). An idle-window seal has no
            # such bound: there a slow read only lets the window run longer, as before
            if _seal_at(session) - loop.time() <= _DUE_S:
                continue
            try:
                records = await asyncio.wait_for(self.transport.discovery.get(dkey), _deadline(session) - loop.time())
            except asyncio.TimeoutError:
                continue
            sealers = sorted(p for p, record in records.items() if p != self.peer_id and p not in session.followers
                             and p not in unreachable and isinstance(record.value, dict)
                             and record.value.get("sealed") is True)
            if sealers:
                # the key's group sealed while we were on our way: nobody is coming to us. Ask the sealer: it answers
                # "late" (those arriving after us are late as well, and meet under the next key), or the group when
                # we are in it and only lost its answer
                session.following = sealers[0]
                self._hand_over(session, session.following)
                return None
            smaller = {p: _rank(p, record) for p, record in records.items()
                       if _rank(p, record) < self._own_rank(session) and p not in unreachable and not self.bans.is_banned(p)}
            if smaller:
                session.following = min(smaller, key=smaller.__getitem__)
                self._hand_over(session, session.following)
                return None
        members = tuple(sorted([self.peer_id, *session.followers]))
        session.sealed = True
        if len(members) < self.config.min_group_size:
            for follower in session.followers.values():
                follower.answer.set_result(("late", "too few peers"))
            self._remember_sealed(session.key)
            raise MatchmakingFailed(
                f"only {len(members)} peer(s) for {session.key!r}, min_group_size={self.config.min_group_size}"
            )
        infos = {peer: f.info for peer, f in session.followers.items()}
        infos[self.peer_id] = session.info
        group = Group(secrets.token_hex(8), session.key, self.peer_id, members, infos)
        for follower in session.followers.values():
            follower.answer.set_result(("group", group))
        return group

    async def _follow(self, session: _Session, leader: str) -> tuple[str, Any]:
        """Ask ``leader`` to admit us; returns (kind, value) with kind in group|redirect|unreachable|refused|late|gone."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        remaining = session.deadline - loop.time()
        request = {"key": session.key, "info": session.info, "remaining_s": max(0.0, remaining)}
        if session.expects is not None:
            request["expects"] = list(session.expects)
        try:
            reply = await call(self.transport.streams, leader, self.prefix, "join", request,
                               timeout_s=max(0.0, remaining) + cfg.request_timeout_s,
                               connect_timeout_s=cfg.request_timeout_s)
            header = reply.header
            kind = require(header, "type", str)
            if kind == "group":
                members = tuple(require(header, "members", list))
                infos = require(header, "infos", dict)
                if self.peer_id not in members or set(infos) != set(members):
                    raise ProtocolViolation("group answer does not list us or lacks member infos")
                return "group", Group(require(header, "group_id", str), session.key, leader, members, infos)
            if kind == "redirect":
                return "redirect", require(header, "leader", str)
            raise ProtocolViolation(f"unknown answer type {kind!r}")
        except Refused as e:
            if e.code in ("refused", "late", "gone"):
                return e.code, e.reason
            return "unreachable", repr(e)
        except RpcError as e:
            return "unreachable", repr(e)

    def on_bad_request(self, peer: str, method: str, error: RpcError) -> None:
        logger.warning("malformed join request from %s: %s", peer, error)

    async def rpc_join(self, request: Request) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        peer = request.peer
        key = require(request.header, "key", str)
        info = require(request.header, "info", dict)
        remaining = float(require(request.header, "remaining_s", (int, float)))
        expects = request.header.get("expects", [])
        if not isinstance(expects, list) or len(expects) > _MAX_EXPECTS or not all(isinstance(p, str) for p in expects):
            raise ProtocolViolation(f"'expects' must be a list of at most {_MAX_EXPECTS} PeerIDs")
        if key == _PROBE_KEY:
            keys = [*self._sessions, *(k for k in reversed(self._sealed_keys) if k not in self._sessions)]
            return {"type": "alive", "keys": keys[:_PROBE_MAX_KEYS]}
        session = self._sessions.get(key)
        if session is None or session.sealed:
            sealed = self._sealed_keys.get(key)
            if sealed is not None and peer in sealed.members:
                return _group_answer(sealed)
            if session is not None or key in self._sealed_keys:
                raise Refused(f"{self.peer_id} already sealed {key!r}", "late")
            raise Refused(f"{self.peer_id} is not matchmaking for {key!r}", "gone")
        if session.following is not None:
            return {"type": "redirect", "leader": session.following}
        reason = f"banned: {self.bans.reason(peer)}" if self.bans.is_banned(peer) else None
        if reason is None and self.admit is not None:
            reason = self.admit(session.info, peer, info)
        if reason is not None:
            raise Refused(reason, "refused")
        now = loop.time()
        follower = _Follower(info, now + min(remaining, self.config.max_wait), loop.create_future())
        previous = session.followers.pop(peer, None)
        if previous is not None and not previous.answer.done():
            previous.answer.set_result(("unreachable", "superseded by a newer join request"))
        if previous is None:  # the group grew: give the ones still on their way another idle window
            session.idle_until = max(session.idle_until, now + self.config.matchmaking_timeout_s)
        session.followers[peer] = follower
        if session.pooled is not None:
            session.pooled.update(expects)
        session.changed.set()
        watcher = asyncio.ensure_future(_watch_closed(request, follower))
        try:
            kind, value = await follower.answer
        finally:
            watcher.cancel()
        if kind == "group":
            return _group_answer(value)
        if kind == "redirect":
            return {"type": "redirect", "leader": value}
        raise Refused(str(value), "late")


def _forget(tasks: set) -> Callable[[asyncio.Task], None]:
    """Done callback: drop the task from ``tasks`` and retrieve its exception (a failed store is only logged)."""
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("could not mark a sealed group in discovery: %r", task.exception())
    return done


async def _watch_closed(request: Request, follower: _Follower) -> None:
    """Flag the follower as gone when its join stream ends (it sends nothing after the request)."""
    await request.remote_closed()
    follower.closed.set()
