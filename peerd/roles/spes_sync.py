"""SPES sparse sync (arXiv 2602.11543): shared parameters averaged among all live peers, each expert only among the
peers that train it, and the untrained copies refreshed from a holder's result. Only trained parameters go through
the all-reduce.

The reference syncs through a central parameter server; here each fragment (``shared``, ``expert<e>``, from
:func:`peerd.roles.fragments.fragment`) has its own group scope, matchmaker and butterfly all-reduce, and every peer
serves its experts' synced values (a :class:`protocols.state_transfer.StateServer`, in the all-reduce codec's
dtype: fp16/bf16 results are exact in it, so a refreshed copy is bit-identical at half the bytes) for the peers that
do not train them. Averaging is of the parameters themselves, weighted by the samples each peer trained on since the last sync
(SPES's outer step is plain averaging: outer learning rate 1, no momentum).

The shared fragment's group forms first and carries each member's claim in its join info; every expert group's size
and every refresh source come from that one sealed group, so the members of a round agree on them whatever their
own views of the published claims.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional, Sequence

import torch

from peerd.models.moe import MoETransformer, expert_parameter_names, shared_parameter_names
from peerd.identity.namespace import RunNamespace
from peerd.runtime.processes import stop_all
from peerd.roles.fragments import Fragment, fragment
from protocols.allreduce import AllReduceConfig, AllReduceFailed, ButterflyAllReduce
from protocols.bans import BanList
from protocols.group_keys import RoundTries
from protocols.matchmaking import Group, Matchmaker, MatchmakingConfig, MatchmakingFailed
from protocols.spes import PeerClaim, claim_record, holders_of, parse_claim
from protocols.state_transfer import StateServer, StateSnapshot, StateTransferFailed, download_state
from protocols.wire import ProtocolViolation

logger = logging.getLogger(__name__)

#: all-reduce codec -> dtype of the served expert copies: the all-reduce's results are exactly representable in it,
#: so refreshed copies stay bit-identical to the holders' at half the bytes.
REFRESH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class _CountingStateServer(StateServer):
    """A :class:`StateServer` that also counts the payload bytes of the answers it sent, per served round."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bytes_served = 0
        #: snapshot round -> payload bytes sent / PeerIDs served
        self.bytes_by_round: dict[int, int] = {}
        self.served_to: dict[int, set[str]] = {}
        self.changed = asyncio.Event()

    async def rpc_state(self, request) -> None:
        before, snapshot = self.served, self.get_snapshot()
        await super().rpc_state(request)
        if self.served > before and snapshot is not None:
            r = snapshot.metadata.get("round")
            self.bytes_served += len(snapshot.payload)
            self.bytes_by_round[r] = self.bytes_by_round.get(r, 0) + len(snapshot.payload)
            self.served_to.setdefault(r, set()).add(request.peer)
            for old in [k for k in self.served_to if not isinstance(r, int) or not isinstance(k, int) or k < r - 4]:
                del self.served_to[old]  # a few recent rounds are all anyone waits on
            self.changed.set()


def refresh_plan(missing: dict[int, Sequence[str]]) -> list[str]:
    """The holders a peer downloads from, in order, to refresh the experts ``missing`` (expert -> its holders): the
    holder with most of the still-missing experts first (lowest PeerID among equals), until every expert is
    covered. What :meth:`SparseSync._refresh` does when every download succeeds; a holder computes it for the other
    members to know who will ask it."""
    missing = {e: list(hs) for e, hs in missing.items() if hs}
    plan = []
    while missing:
        coverage: dict[str, list[int]] = {}
        for e, hs in missing.items():
            for p in hs:
                coverage.setdefault(p, []).append(e)
        peer = max(sorted(coverage), key=lambda p: len(coverage[p]))
        plan.append(peer)
        missing = {e: hs for e, hs in missing.items() if peer not in hs}
    return plan


@dataclass
class SparseSyncReport:
    """One sync of one peer (bytes in bytes). ``group_sizes``: fragment -> members of its all-reduce (1: this peer
    was its only holder, nothing travelled). ``failed``: fragment -> why it kept its local values.
    ``refreshed``: experts whose untrained copy was replaced by a holder's synced copy."""

    allreduce_bytes_sent: int = 0
    allreduce_bytes_received: int = 0
    refresh_bytes_received: int = 0
    group_sizes: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    refreshed: list[int] = field(default_factory=list)
    seconds: float = 0.0
    downloaders: frozenset[str] = frozenset()
    """Members that will download this peer's synced experts (their :func:`refresh_plan` includes it)."""
    claims: dict[str, PeerClaim] = field(default_factory=dict)
    """The shared group's members and the experts each trained this round, as they joined the group: the same
    on every member, the view the re-claim after the round starts from."""


class SparseSync:
    """One peer's SPES sync over ``transport``. Call :meth:`start` once, :meth:`sync` every ``sync_steps``.

    Args:
        transport: the peer's transport (``protocols.interfaces.Transport``).
        ns, role: the run's namespace and the role name; fragment scopes are ``ns.scoped(fragment=...).prefix(role)``.
        model: the peer's :class:`MoETransformer` (all experts present).
        own: the experts this peer trains (update with :meth:`set_own` after a re-claim).
    """

    def __init__(self, transport, ns: RunNamespace, role: str, model: MoETransformer, own: Collection[int],
                 matchmaking: MatchmakingConfig, allreduce: AllReduceConfig, bans: Optional[BanList] = None,
                 refresh_timeout_s: float = 30.0):
        self.transport = transport
        self.model = model
        self.n_experts = model.config.n_experts
        self.shared = fragment(model, "shared", shared_parameter_names(model), ns, role)
        self.tries = RoundTries(self.shared.name)  # the shared group's failed tries of the current round
        self.experts = [fragment(model, f"expert{e}", expert_parameter_names(model, e), ns, role)
                        for e in range(self.n_experts)]
        self.bans = bans
        self.refresh_timeout_s = refresh_timeout_s
        extra = {"bans": bans} if bans is not None else {}
        self._services: dict[str, tuple[Matchmaker, ButterflyAllReduce]] = {
            frag.name: (Matchmaker(transport, frag.scope, matchmaking, **extra),
                        ButterflyAllReduce(transport, frag.scope, allreduce, **extra))
            for frag in [self.shared, *self.experts]}
        self.served_prefix = ns.scoped(fragment="experts-served").prefix(role)
        self.server = _CountingStateServer(transport, self.served_prefix, self._snapshot)
        self.own = frozenset(own)
        self._served: Optional[StateSnapshot] = None
        self.codec = allreduce.make_codec()
        self.refresh_dtype = REFRESH_DTYPES.get(allreduce.compression, torch.float32)

    async def start(self) -> None:
        for mm, ar in self._services.values():
            await mm.start()
            await ar.start()
        await self.server.start()

    async def stop(self) -> None:
        await stop_all([self.server, *(c for pair in self._services.values() for c in pair)])

    def set_own(self, own: Collection[int]) -> None:
        self.own = frozenset(own)

    def _snapshot(self) -> Optional[StateSnapshot]:
        return self._served

    @property
    def refresh_bytes_served(self) -> int:
        """Payload bytes of the synced expert copies this peer has served to others, since :meth:`start`."""
        return self.server.bytes_served

    def refresh_bytes_served_in(self, outer_round: int) -> int:
        """Payload bytes of the expert copies served after sync round ``outer_round``."""
        return self.server.bytes_by_round.get(outer_round + 1, 0)

    async def wait_served(self, outer_round: int, peers: Collection[str], timeout_s: float) -> bool:
        """Wait (at most ``timeout_s`` seconds) until ``peers`` have downloaded the expert copies of sync round
        ``outer_round``; True if they all did."""
        deadline = time.monotonic() + timeout_s
        while not set(peers) <= self.server.served_to.get(outer_round + 1, set()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.server.changed.clear()
            try:
                await asyncio.wait_for(self.server.changed.wait(), remaining)
            except asyncio.TimeoutError:
                return False
        return True

    def trained_numel(self) -> int:
        """Parameters this peer trains and all-reduces: shared + its own experts."""
        return self.shared.numel(self.model) + sum(self.experts[e].numel(self.model) for e in self.own)

    async def _average(self, frag: Fragment, key: str, expected: int, weight: float, report: SparseSyncReport):
        if expected <= 1:  # sole holder: its copy is the average, rounded as an all-reduce would round it
            flat = frag.flatten(self.model)
            frag.load_(self.model, self.codec.decode(self.codec.encode(flat), flat.numel()))
            report.group_sizes[frag.name] = 1
            return
        mm, _ = self._services[frag.name]
        try:
            group = await mm.form_group(key, {}, expected_size=expected)
        except (MatchmakingFailed, asyncio.TimeoutError) as e:
            report.failed[frag.name] = str(e)
            return
        await self._reduce(frag, group, weight, report)

    async def _reduce(self, frag: Fragment, group: Group, weight: float, report: SparseSyncReport) -> None:
        _, ar = self._services[frag.name]
        try:
            result = await ar.run(group, frag.flatten(self.model), weight)
        except (AllReduceFailed, asyncio.TimeoutError) as e:
            report.failed[frag.name] = str(e)
            return
        frag.load_(self.model, result.averaged)
        report.group_sizes[frag.name] = result.group_size
        report.allreduce_bytes_sent += result.bytes_sent
        report.allreduce_bytes_received += result.bytes_received

    def _member_claims(self, group: Group) -> dict[str, PeerClaim]:
        """The claims the shared group's members joined with: the same on every member (the leader hands every
        member all infos), so all of them derive the same expert groups. A malformed info counts as a member that
        trains no expert (it still averages the shared parameters)."""
        claims = {}
        for peer in group.members:
            parsed = parse_claim(group.infos.get(peer), self.n_experts)
            if parsed is None:
                logger.warning("%s joined %s with a malformed claim; it syncs no expert", peer, group.key)
                claims[peer] = PeerClaim(frozenset(), 0)
            else:
                claims[peer] = parsed[0]
        return claims

    async def sync(self, outer_round: int, live: int, weight: float, capacity: int = 0,
                   records: Optional[Mapping[str, Mapping]] = None) -> SparseSyncReport:
        """Sync round ``outer_round``.

        The shared fragment's group forms first; each member joins it with its claim (its experts and
        ``capacity``), and every expert's group size is then the number of its holders among those members. All
        members read the claims from the one sealed group, so they agree on every expert group's size even when
        their views of the published claims differ (a view that misses a holder would otherwise seal a group
        without it, or skip the all-reduce of an expert it believes it holds alone).

        Args:
            live: peers expected to sync the shared parameters this round, this one included (the matchmaking
                leader seals the group once that many have joined; 1: sync alone, without matchmaking).
            weight: samples this peer trained on since the last sync (> 0).
            capacity: most experts this peer can train, published to the group for the re-claim.
            records: the other peers' status records (PeerID -> record): their failed tries of this round
                (:data:`protocols.group_keys.RETRIES_FIELD`), so a round whose shared matchmaking failed is tried
                again under the fresh key they agree on (:class:`protocols.group_keys.RoundTries`).

        Returns:
            A :class:`SparseSyncReport`; ``claims`` holds the members' claims (PeerID -> PeerClaim). A failed shared
            matchmaking syncs nothing; another failed fragment keeps its local values (retried at the next sync).
        """
        started = time.perf_counter()
        report = SparseSyncReport()
        key = self.tries.try_key(outer_round, records or {})
        me = self.transport.streams.peer_id
        # nothing to serve while averaging: a refresher polling early gets a cheap refusal, not last round's copy
        self._served = None
        mine = PeerClaim(self.own, int(capacity))
        if live <= 1:
            group = None
            report.claims = {me: mine}
        else:
            mm, _ = self._services[self.shared.name]
            try:
                group = await mm.form_group(key, claim_record(self.own, capacity, outer_round), expected_size=live)
            except (MatchmakingFailed, asyncio.TimeoutError) as e:
                self.tries.failed()
                report.failed[self.shared.name] = str(e)
                report.seconds = round(time.perf_counter() - started, 3)
                return report
            report.claims = self._member_claims(group)
            report.claims[me] = mine  # our own claim as we hold it (a round trip cannot change it)
        holders = holders_of({p: c.experts for p, c in report.claims.items()}, self.n_experts)
        if group is None:
            jobs = [self._average(self.shared, key, 1, weight, report)]
        else:
            jobs = [self._reduce(self.shared, group, weight, report)]
        jobs += [self._average(self.experts[e], key, len(holders[e]), weight, report) for e in sorted(self.own)]
        await asyncio.gather(*jobs)
        if self.shared.name in report.failed:  # the round is tried again, under a fresh key
            self.tries.failed()
        self._served = StateSnapshot.from_tensors(
            {f"expert{e}": self.experts[e].flatten(self.model).to(self.refresh_dtype) for e in sorted(self.own)},
            {"round": outer_round + 1, "experts": sorted(self.own)})
        report.downloaders = frozenset(
            m for m, c in report.claims.items()
            if m != me and me in refresh_plan({e: [p for p in holders[e] if p != m]
                                               for e in range(self.n_experts) if e not in c.experts}))
        missing = {e: [p for p in holders[e] if p != me] for e in range(self.n_experts) if e not in self.own}
        await self._refresh({e: hs for e, hs in missing.items() if hs}, outer_round + 1, report)
        report.seconds = round(time.perf_counter() - started, 3)
        return report

    async def _refresh(self, missing: dict[int, list[str]], want_round: int, report: SparseSyncReport) -> None:
        """Replace each untrained expert by a holder's synced copy; fewest downloads first (a holder that has
        several of the missing experts serves them in one answer)."""
        deadline = time.monotonic() + self.refresh_timeout_s
        while missing and time.monotonic() < deadline:
            peer = refresh_plan(missing)[0]
            got = await self._download(peer, want_round, deadline, report)
            if got is None:  # this holder failed: the others may still serve these experts
                for hs in missing.values():
                    if peer in hs:
                        hs.remove(peer)
                missing = {e: hs for e, hs in missing.items() if hs}
                continue
            for e, flat in got.items():
                if e in missing:
                    self.experts[e].load_(self.model, flat)
                    report.refreshed.append(e)
                    del missing[e]
            for hs in missing.values():  # it served all it holds: asking it again would bring nothing new
                if peer in hs:
                    hs.remove(peer)
            missing = {e: hs for e, hs in missing.items() if hs}
        for e in missing:
            report.failed[f"expert{e}"] = "no holder served its synced copy"

    async def _download(self, peer: str, want_round: int, deadline: float, report: SparseSyncReport
                        ) -> Optional[dict[int, torch.Tensor]]:
        # A holder serves its synced copy once its own averaging is done: poll until the round matches.
        max_bytes = self.refresh_dtype.itemsize * sum(frag.numel(self.model) for frag in self.experts) + 4096
        while time.monotonic() < deadline:
            try:
                snapshot = await download_state(self.transport, self.served_prefix, peer, max_bytes,
                                                timeout_s=max(0.1, deadline - time.monotonic()))
                meta = snapshot.metadata
                experts = meta.get("experts")
                if not (isinstance(experts, list) and all(isinstance(e, int) and 0 <= e < self.n_experts
                                                          for e in experts) and len(set(experts)) == len(experts)):
                    raise ProtocolViolation(f"bad expert list {experts!r}")
                if meta.get("round") != want_round:
                    await asyncio.sleep(0.05)
                    continue
                tensors = snapshot.tensors({f"expert{e}": (self.refresh_dtype, self.experts[e].numel(self.model))
                                            for e in experts})
            except StateTransferFailed as e:
                if "no state to serve" in str(e):
                    await asyncio.sleep(0.05)
                    continue
                logger.info("expert refresh from %s failed: %s", peer, e)
                return None
            except ProtocolViolation as e:
                logger.warning("expert refresh from %s: bad answer (%s); banning it", peer, e)
                if self.bans is not None:
                    self.bans.ban(peer, str(e))
                return None
            report.refresh_bytes_received += len(snapshot.payload)
            return {int(name.removeprefix("expert")): t.float() for name, t in tensors.items()}
        return None
