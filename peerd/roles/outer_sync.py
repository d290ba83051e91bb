"""Outer-sync strategies: how one fragment's outer state meets the swarm's in an outer round.

One class per averaging method, behind :class:`OuterSync`; :data:`peerd.roles.registry.OUTER_SYNCS` maps the run
config's ``averaging.method`` to its class (the only place that looks at the method name).

- :class:`AllReduceSync` (DiLoCo, Douillard et al. 2023, Alg. 1): butterfly-all-reduce the pseudo-gradients of
  everyone present, then apply the shared outer step: theta_outer stays bit-identical across the swarm.
- :class:`MoshpitSync` (Ryabinin et al. 2021): apply our own outer step, then average the outer state in this
  round's grid group.
- :class:`GossipSync`: apply our own outer step, then average the outer state with random partners.

Contract: :meth:`OuterSync.round` takes theta_local of the fragment ((P,) fp32), its weight (samples since the
last successful round), the live workers' status records and the PeerIDs of peers without such a record that the
round should wait for (downloading the state to join it, or the last group's members whose records lapsed); it
returns a :class:`RoundResult` after updating ``state.outer``, a :class:`RoundFailure` with ``state.outer``
untouched, :class:`Refused` (the leader's theta_outer differs: adopt its state), or None when a stop or a pause
abandoned the round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional, Union

import torch

from peerd.runtime.processes import stop_all
from peerd.roles.base import RunContext, bounded_on_stop, unless_stopped
from peerd.roles.fragments import FragmentState
from peerd.roles.registry import OUTER_SYNCS, resolve
from protocols.allgather import SparseAllGather
from protocols.allreduce import AllReduceFailed, AllReduceResult, ButterflyAllReduce, RingAllReduce
from protocols.codecs import ErrorFeedback
from protocols.diloco import DiLoCoHyperparams, OuterState
from protocols.group_keys import RETRIES_FIELD, RoundTries, agreed_retry, group_key  # noqa: F401 (re-exported)
from protocols.gossip import GossipAverager
from protocols.matchmaking import AdmissionRefused, Matchmaker, MatchmakingFailed, SealedWithout
from protocols.moshpit import MoshpitAverager, round_to_join

logger = logging.getLogger(__name__)

#: An all-reduce that fails (a member died mid-round) is tried this many times in all, among the survivors.
MAX_ROUND_ATTEMPTS = 2

@dataclass(frozen=True)
class RoundResult:
    """A completed exchange (bytes in bytes, seconds). ``failure``: a mixing exchange that failed while our own
    outer step was kept (the round still counts)."""

    group_size: int
    bytes_sent: int
    bytes_received: int
    allreduce_s: float
    excluded: dict = field(default_factory=dict)
    attempts: int = 1
    failure: Optional[str] = None


@dataclass(frozen=True)
class RoundFailure:
    """The round failed: ``state.outer`` is unchanged and the local steps are kept for the next attempt."""

    reason: str


@dataclass(frozen=True)
class LeftOut(RoundFailure):
    """The round's group sealed (led by ``leader``) before we joined it: the round goes on without us, and the
    leader's state after round ``outer_round`` is the swarm's. ``state.outer`` is unchanged, as for any failure."""

    leader: str
    outer_round: int


@dataclass(frozen=True)
class Refused:
    """The round's leader refused us (``reason``); its state after round ``outer_round`` is the one to adopt."""

    leader: str
    reason: str
    outer_round: int


RoundOutcome = Union[RoundResult, RoundFailure, Refused, None]


class OuterSync:
    """One fragment's outer sync. ``catch_up_margin``: rounds a live peer must be ahead before we download its state
    instead of syncing (None: never, the method has no shared rounds). ``same_theta``: members must share
    theta_outer (its digest is checked at admission)."""

    method: ClassVar[str]
    catch_up_margin: ClassVar[Optional[int]]
    same_theta: ClassVar[bool] = False

    def __init__(self, ctx: RunContext, state: FragmentState, hp: Optional[DiLoCoHyperparams] = None):
        self.ctx = ctx
        self.state = state
        self.hp = hp if hp is not None else ctx.run.diloco
        self.components: tuple = ()
        self.last_members: frozenset[str] = frozenset()
        """The last completed group's members less the excluded ones (methods with groups; empty otherwise)."""

    def retries(self) -> Optional[list[int]]:
        """``[outer round, failed tries of it]`` for the status record (:data:`RETRIES_FIELD`); None when the current
        round has not failed, or the method has no shared rounds to retry."""
        return None

    async def start(self) -> None:
        for component in self.components:
            await component.start()

    async def stop(self) -> None:
        await stop_all(self.components)

    def _admit(self, own_info: dict, peer: str, info: dict) -> Optional[str]:
        allowlist = self.ctx.run.allowlist
        if allowlist and peer not in allowlist:
            return "not on the run's allowlist"
        if self.same_theta and info.get("digest") != own_info.get("digest"):
            return f"theta_outer digest {str(info.get('digest'))[:12]} differs from the leader's"
        return None

    def _matchmaker(self) -> Matchmaker:
        admit = self._admit if self.same_theta or self.ctx.run.allowlist else None
        return Matchmaker(self.ctx.transport, self.state.fragment.scope, self.ctx.run.averaging.matchmaking(),
                          admit=admit, bans=self.ctx.bans)

    def _allreduce(self) -> Union[ButterflyAllReduce, SparseAllGather]:
        """The butterfly all-reduce; the sparse all-gather where ``[averaging.allreduce] exchange = "gather"``; the
        ring (where the group suits it, else the butterfly) where ``exchange = "ring"``."""
        config = self.ctx.run.averaging.allreduce()
        cls = {"gather": SparseAllGather, "ring": RingAllReduce}.get(config.exchange, ButterflyAllReduce)
        return cls(self.ctx.transport, self.state.fragment.scope, config, bans=self.ctx.bans)

    def _set_dial_only(self) -> None:
        """Behind a NAT (the dial-back check found that nobody can dial us): announce ``dial_only`` in the group info,
        so that we lead no group and reduce no part and every stream of the round is one we open (relayed bytes are
        slow and a relay's circuits are limited). Read from the status board at each round: the check's verdict
        comes after joining."""
        self.allreduce.dial_only = self.ctx.status.reachable is False

    async def round(self, local: torch.Tensor, weight: float, live: dict[str, dict],
                    syncing: frozenset[str], owned: bool = False, digest: bool = True,
                    retake_local: Optional[Callable[[], torch.Tensor]] = None) -> RoundOutcome:
        """The round after ``state.outer`` with theta_local ``local`` ((P,) fp32 CPU) of ``weight`` samples.
        ``owned``: the caller hands ``local`` over (a fresh copy it never reads again): the round may reuse its
        buffer (the pseudo-gradient and then the new theta_outer are written there, 8P bytes of host memory less
        at the boundary). ``retake_local`` (with ``owned``): gives a fresh copy of theta_local again (the model has
        not moved since ``local`` was taken); with it the all-reduce writes the average over that buffer too (4P
        bytes less again) and an attempt that fails mid-way takes theta_local anew for the next. ``digest``: the
        new state's digest is computed (in a worker thread) before the round returns; False leaves it to the caller
        (:meth:`protocols.diloco.OuterState.digest`)."""
        raise NotImplementedError


class AllReduceSync(OuterSync):
    """Average pseudo-gradients with everyone present; apply the shared outer step (bit-identical theta_outer).

    The group is sealed early once it has every live peer at our round plus the ``syncing`` peers (downloading the
    state to join this round), in the pooled views of all its members (each sends the PeerIDs it expects:
    ``expected_peers`` of :meth:`protocols.matchmaking.Matchmaker.form_group`); otherwise matchmaking waits out its
    idle window. One leader's view alone missed a third of 64 workers on a loaded machine and sealed without them.
    If the all-reduce fails (a member died mid-round), the survivors retry once right away among themselves, under
    a fresh group key. A round that failed is tried again (at the next boundary) under a fresh key too, agreed
    through the status records (:func:`group_key`, :func:`agreed_retry`). A peer that reaches the rendezvous after
    its group sealed (no member's view had its status record) gets :class:`LeftOut`, naming the leader whose state
    to catch up with; that is no failed try of the round.

    With a sparse codec (``compression = "topk"``, SparseLoCo) the pseudo-gradient is sent through this peer's
    :class:`protocols.codecs.ErrorFeedback`: what the codec did not deliver in a completed round is added to the next
    round's pseudo-gradient (a failed round records nothing: its steps stay in theta_local). The error is local
    state, never sent; the DiLoCo role keeps it in its checkpoint.
    ``exchange = "gather"`` swaps the butterfly for :class:`protocols.allgather.SparseAllGather` (members exchange
    their top-k vectors instead of dense answers); ``[diloco] error_feedback_decay`` is SparseLoCo's beta.
    """

    method = "allreduce"
    catch_up_margin = 1  # peers move in lockstep: anyone ahead means we missed a round
    same_theta = True

    def __init__(self, ctx: RunContext, state: FragmentState, hp: Optional[DiLoCoHyperparams] = None):
        super().__init__(ctx, state, hp)
        self.matchmaker = self._matchmaker()
        self.allreduce = self._allreduce()
        self.components = (self.matchmaker, self.allreduce)
        self.feedback = (ErrorFeedback(state.outer.numel, self.hp.error_feedback_decay)
                         if self.allreduce.codec.sparse else None)
        self.tries = RoundTries(state.fragment.name)  # a failed round's next try uses a fresh group key

    def retries(self) -> Optional[list[int]]:
        return self.tries.record(self.state.outer.outer_round)

    async def round(self, local, weight, live, syncing, owned=False, digest=True, retake_local=None):
        outer = self.state.outer
        delta = outer.pseudo_gradient(local, in_place=owned)
        retake = None
        if owned and retake_local is not None and self.feedback is None:
            def retake() -> torch.Tensor:
                return outer.pseudo_gradient(retake_local(), in_place=True)
        exchanged = await self.exchange(delta, weight, live, syncing, retake=retake)
        if not isinstance(exchanged, tuple):
            return exchanged
        result, attempt = exchanged
        # delta is dead once averaged (the error feedback recorded what it needs): its buffer takes the new theta
        # (with ``retake`` it holds the average itself, the last attempt's buffer: apply() steps over it in place)
        out = result.averaged if retake is not None else delta if owned else None
        self.state.outer = await stepped_off_loop(outer, result.averaged, self.hp, out=out, digest=digest)
        return RoundResult(result.group_size, result.bytes_sent, result.bytes_received, round(result.seconds, 3),
                           result.excluded, attempt)

    async def exchange(self, pseudo_gradient: torch.Tensor, weight: float, live: dict[str, dict],
                       syncing: frozenset[str], also_expect: tuple[int, ...] = (),
                       retake: Optional[Callable[[], torch.Tensor]] = None,
                       ) -> Union[tuple[AllReduceResult, int], RoundOutcome]:
        """All-reduce ``pseudo_gradient`` ((P,) fp32) for the round after ``state.outer`` without applying it:
        ``(result, attempts)``, or the :data:`RoundOutcome` that ended it (failure, refusal, None on stop).
        ``also_expect``: other outer rounds whose live peers will join this one (the delayed overlap counts the
        peers that have not reached the round boundary yet). ``retake`` (not with the error feedback): gives the
        pseudo-gradient anew; with it the average is written over ``pseudo_gradient``'s buffer (the result's
        ``averaged`` is that buffer, or the retaken one after a failed attempt)."""
        outer = self.state.outer
        r = outer.outer_round
        me = self.ctx.peer_id
        rounds = (r, *also_expect)
        coming = frozenset(syncing) | {p for p, s in live.items() if s.get("outer_round") in rounds}
        coming -= {me}
        if retake is not None and self.feedback is not None:
            raise ValueError("retake is not supported with the error feedback (it reads the sent vector afterwards)")
        if self.feedback is not None:
            compensated = pseudo_gradient = self.feedback.compensate(pseudo_gradient)
        retry = self.tries.retry(r, {p: s for p, s in live.items() if p != me})
        outcome = await self._tries(r, retry, pseudo_gradient, weight, coming, retake)
        if isinstance(outcome, RoundFailure) and not isinstance(outcome, LeftOut):
            # left out, the round went on: its result is ours to adopt, and a fresh key would only gather the
            # other latecomers into a rival group that forks theta_outer
            self.tries.failed()
        if isinstance(outcome, tuple) and self.feedback is not None:
            self.feedback.record(compensated, outcome[0].sent)
        return outcome

    async def _tries(self, r: int, retry: int, pseudo_gradient: torch.Tensor, weight: float,
                     coming: frozenset[str], retake: Optional[Callable[[], torch.Tensor]] = None,
                     ) -> Union[tuple[AllReduceResult, int], RoundOutcome]:
        outer = self.state.outer
        result = None
        expected, expected_peers = 1 + len(coming), coming
        self._set_dial_only()
        for attempt in range(1, MAX_ROUND_ATTEMPTS + 1):
            key = group_key(r, retry, attempt)
            try:
                group = await unless_stopped(
                    self.ctx, self.matchmaker.form_group(key, {"digest": outer.digest(), **self.allreduce.announce()},
                                                         expected_size=expected, expected_peers=expected_peers))
                if group is None:
                    return None
                run = (self.allreduce.run(group, pseudo_gradient, weight) if retake is None else
                       self.allreduce.run(group, pseudo_gradient, weight, out=pseudo_gradient))
                result = await bounded_on_stop(self.ctx, run)
                if result is not None:
                    self.last_members = frozenset(group.members) - set(result.excluded)
                break
            except AdmissionRefused as e:
                return Refused(e.leader, e.reason, r + 1)
            except SealedWithout as e:
                return LeftOut(str(e), e.leader, r + 1)
            except AllReduceFailed as e:
                if attempt < MAX_ROUND_ATTEMPTS and not self.ctx.stop.is_set():
                    logger.warning("round %d all-reduce failed (%s); retrying among the survivors", r + 1, e)
                    expected, expected_peers = max(1, len(group.members) - 1), None  # who died is not known
                    if retake is not None:  # the failed attempt wrote some parts' averages over it
                        pseudo_gradient = retake()
                    continue
                return RoundFailure(str(e))
            except (MatchmakingFailed, asyncio.TimeoutError) as e:
                return RoundFailure(str(e))
        if result is None:
            return None
        return result, attempt


class _MixingSync(OuterSync):
    """Apply our own outer step onto the current state (gossip may have mixed it), then average the outer state.
    A failed exchange keeps our own step: peers drift apart a little until a later exchange pulls them together."""

    async def _exchange(self, r: int, stepped: OuterState, weight: float, peers: list[str],
                        live: dict[str, dict]) -> Optional[RoundResult]:
        """Average ``stepped`` with some of ``peers`` (sorted PeerIDs, ours included; ``live``: their status
        records)."""
        raise NotImplementedError

    async def round(self, local, weight, live, syncing, owned=False, digest=True, retake_local=None):
        r = self._round_to_join(live)
        delta = self.state.round_start_theta - local  # own pseudo-gradient (P,)
        stepped = self.state.outer.apply(delta, self.hp)
        stepped = OuterState(stepped.theta, stepped.momentum, r + 1)
        me = self.ctx.peer_id
        peers = sorted(live) if me in live else sorted([*live, me])
        started = time.perf_counter()
        failure = None
        try:
            result = await self._exchange(r, stepped, weight, peers, live)
        except (MatchmakingFailed, AllReduceFailed) as e:
            result, failure = None, str(e)
        if result is None:
            result = RoundResult(1, 0, 0, 0.0, {}, 1, failure)
        return RoundResult(result.group_size, result.bytes_sent, result.bytes_received,
                           round(time.perf_counter() - started, 3), result.excluded, 1, failure)

    def _round_to_join(self, live: dict[str, dict]) -> int:
        return self.state.outer.outer_round


class MoshpitSync(_MixingSync):
    method = "moshpit"
    catch_up_margin = 2  # groups progress independently: only a gap of two rounds means our groupmates are gone

    def __init__(self, ctx: RunContext, state: FragmentState, hp: Optional[DiLoCoHyperparams] = None):
        super().__init__(ctx, state, hp)
        self.matchmaker = self._matchmaker()
        self.allreduce = self._allreduce()
        self.moshpit = MoshpitAverager(self.matchmaker, self.allreduce, ctx.run.averaging.group_size)
        self.components = (self.matchmaker, self.allreduce)

    def _round_to_join(self, live):
        r = self.state.outer.outer_round
        rounds = {p: s["outer_round"] for p, s in live.items() if p != self.ctx.peer_id}
        joined = round_to_join(self.ctx.peer_id, rounds, r, self.ctx.run.averaging.group_size)
        if joined != r:
            logger.info("our moshpit groupmates moved on: joining round %d instead of %d", joined + 1, r + 1)
            outer = self.state.outer
            self.state.outer = OuterState(outer.theta, outer.momentum, joined)
        return joined

    async def _exchange(self, r, stepped, weight, peers, live):
        packed = torch.cat([stepped.theta, stepped.momentum])  # (2P,)
        self._set_dial_only()
        try:
            result = await unless_stopped(self.ctx, self.moshpit.average(r, packed, weight, peers))
        finally:  # our status keeps showing round r until the group is done: others match with us
            self.state.outer = stepped
        if result is None:
            return None
        self.state.outer = unpack(result.averaged, r + 1)
        return RoundResult(result.group_size, result.bytes_sent, result.bytes_received, 0.0, result.excluded)


class GossipSync(_MixingSync):
    method = "gossip"
    catch_up_margin = None  # gossip has no rounds to share

    def __init__(self, ctx: RunContext, state: FragmentState, hp: Optional[DiLoCoHyperparams] = None):
        super().__init__(ctx, state, hp)
        self.gossip = GossipAverager(ctx.transport, state.fragment.scope, ctx.run.averaging.gossip(),
                                     self._gossip_state, self._set_gossip_state, bans=ctx.bans)
        self.components = (self.gossip,)
        self._bytes = (0, 0)  # the averager's byte counters at our last round
        self._served = 0  # and its count of exchanges answered

    def _gossip_state(self) -> tuple[torch.Tensor, float]:
        return torch.cat([self.state.outer.theta, self.state.outer.momentum]), self.state.gossip_weight

    def _set_gossip_state(self, packed: torch.Tensor, weight: float) -> None:
        self.state.outer = unpack(packed, self.state.outer.outer_round)
        self.state.gossip_weight = weight

    async def _exchange(self, r, stepped, weight, peers, live):
        self.state.outer, self.state.gossip_weight = stepped, weight
        # peers found unreachable are not dialed while another partner can be (they start exchanges themselves)
        dialable = [p for p in peers if live.get(p, {}).get("reachable") is not False or p == self.ctx.peer_id]
        result = await unless_stopped(self.ctx, self.gossip.gossip_round(dialable if len(dialable) > 1 else peers))
        if result is None:
            return None
        # exchanges we answered since our last round mixed other peers' states into ours as well: they count in the
        # round's group size and bytes, not only the exchanges we started
        sent, received, served = self.gossip.bytes_sent, self.gossip.bytes_received, self.gossip.served
        out = RoundResult(1 + result.exchanges + served - self._served, sent - self._bytes[0],
                          received - self._bytes[1], 0.0)
        self._bytes, self._served = (sent, received), served
        return out


def make_outer_sync(ctx: RunContext, state: FragmentState, hp: Optional[DiLoCoHyperparams] = None) -> OuterSync:
    """The run's strategy for ``state``, decorated by ``ctx.wrap_sync``; its outer step uses ``hp`` (None: the run's
    ``[diloco]``). Raises KeyError for an unknown method."""
    cls = resolve(OUTER_SYNCS, ctx.run.averaging.method, "averaging method")
    return ctx.wrap_sync(cls(ctx, state, hp))


def unpack(packed: torch.Tensor, outer_round: int) -> OuterState:
    """(2P,) = [theta_outer, momentum] back into an OuterState (validated: shapes, finite values)."""
    numel = packed.numel() // 2
    return OuterState(packed[:numel].clone(), packed[numel:].clone(), outer_round)


async def stepped_off_loop(outer: OuterState, averaged: torch.Tensor, hp: DiLoCoHyperparams,
                           out: Optional[torch.Tensor] = None, digest: bool = True) -> OuterState:
    """``outer.apply(averaged, hp, out)`` with the new state's digest (kept by the state; only if ``digest``),
    computed in a worker thread.
    On the event loop they held every other task of the peer (its DHT node, state downloads it serves, its status
    record) for the time of two passes over P values and a SHA-256 of 8P bytes: seconds for a billion parameters.
    Raises ValueError as :meth:`protocols.diloco.OuterState.apply`."""

    def step() -> OuterState:
        stepped = outer.apply(averaged, hp, out)
        if digest:
            stepped.digest()
        return stepped

    return await asyncio.get_running_loop().run_in_executor(None, step)
