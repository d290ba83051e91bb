"""SPES sparse sync (arXiv 2602.11543): shared parameters averaged among all live peers, each expert only among the
peers that train it, and the untrained copies refreshed from a holder's result. Only trained parameters go through
the all-reduce.

The reference syncs through a central parameter server; here each fragment (``shared``, ``expert<e>``, from
:func:`peerd.roles.fragments.fragment`) has its own group scope, matchmaker and butterfly all-reduce, and every peer
serves its experts' synced values (a :class:`protocols.state_transfer.StateServer`, in the all-reduce codec's
dtype: fp16/bf16 results are exact in it, so a refreshed copy is bit-identical at half the bytes) for the peers that
do not train them. Averaging is of the parameters themselves, weighted by the samples each peer trained on since the last sync
(SPES's outer step is plain averaging: outer learning rate 1, no momentum).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Collection, Optional, Sequence

import torch

from peerd.models.moe import MoETransformer, expert_parameter_names, shared_parameter_names
from peerd.namespace import RunNamespace
from peerd.roles.fragments import Fragment, fragment
from protocols.allreduce import AllReduceConfig, AllReduceFailed, ButterflyAllReduce
from protocols.bans import BanList
from protocols.codecs import get_codec
from protocols.matchmaking import Matchmaker, MatchmakingConfig, MatchmakingFailed
from protocols.state_transfer import StateServer, StateSnapshot, StateTransferFailed, download_state
from protocols.wire import ProtocolViolation

logger = logging.getLogger(__name__)

#: all-reduce codec -> dtype of the served expert copies: the all-reduce's results are exactly representable in it,
#: so refreshed copies stay bit-identical to the holders' at half the bytes.
REFRESH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class _CountingStateServer(StateServer):
    """A :class:`StateServer` that also counts the payload bytes of the answers it sent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bytes_served = 0

    async def rpc_state(self, request) -> None:
        before, snapshot = self.served, self.get_snapshot()
        await super().rpc_state(request)
        if self.served > before and snapshot is not None:
            self.bytes_served += len(snapshot.payload)


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
        self.codec = get_codec(allreduce.compression)
        self.refresh_dtype = REFRESH_DTYPES.get(allreduce.compression, torch.float32)

    async def start(self) -> None:
        for mm, ar in self._services.values():
            await mm.start()
            await ar.start()
        await self.server.start()

    async def stop(self) -> None:
        for component in [self.server, *(c for pair in self._services.values() for c in pair)]:
            try:
                await component.stop()
            except Exception:  # best effort: the transport goes down next
                logger.debug("could not stop %r", component, exc_info=True)

    def set_own(self, own: Collection[int]) -> None:
        self.own = frozenset(own)

    def _snapshot(self) -> Optional[StateSnapshot]:
        return self._served

    @property
    def refresh_bytes_served(self) -> int:
        """Payload bytes of the synced expert copies this peer has served to others, since :meth:`start`."""
        return self.server.bytes_served

    def trained_numel(self) -> int:
        """Parameters this peer trains and all-reduces: shared + its own experts."""
        return self.shared.numel(self.model) + sum(self.experts[e].numel(self.model) for e in self.own)

    async def _average(self, frag: Fragment, key: str, expected: int, weight: float, report: SparseSyncReport):
        if expected <= 1:  # sole holder: its copy is the average, rounded as an all-reduce would round it
            flat = frag.flatten(self.model)
            frag.load_(self.model, self.codec.decode(self.codec.encode(flat), flat.numel()))
            report.group_sizes[frag.name] = 1
            return
        mm, ar = self._services[frag.name]
        try:
            group = await mm.form_group(key, {}, expected_size=expected)
            result = await ar.run(group, frag.flatten(self.model), weight)
        except (MatchmakingFailed, AllReduceFailed, asyncio.TimeoutError) as e:
            report.failed[frag.name] = str(e)
            return
        frag.load_(self.model, result.averaged)
        report.group_sizes[frag.name] = result.group_size
        report.allreduce_bytes_sent += result.bytes_sent
        report.allreduce_bytes_received += result.bytes_received

    async def sync(self, outer_round: int, holders: Sequence[Sequence[str]], live: int, weight: float
                   ) -> SparseSyncReport:
        """Sync round ``outer_round``.

        Args:
            holders: for each expert, the live PeerIDs that train it (:func:`protocols.spes.holders_of`), this peer
                included where it does.
            live: live peers that sync the shared parameters this round, this one included.
            weight: samples this peer trained on since the last sync (> 0).

        Returns:
            A :class:`SparseSyncReport`; a failed fragment keeps its local values (retried at the next sync).
        """
        started = time.perf_counter()
        report = SparseSyncReport()
        key = f"round{outer_round}"
        me = self.transport.streams.peer_id
        # nothing to serve while averaging: a refresher polling early gets a cheap refusal, not last round's copy
        self._served = None
        jobs = [self._average(self.shared, key, live, weight, report)]
        jobs += [self._average(self.experts[e], key, len(holders[e]), weight, report) for e in sorted(self.own)]
        await asyncio.gather(*jobs)
        self._served = StateSnapshot.from_tensors(
            {f"expert{e}": self.experts[e].flatten(self.model).to(self.refresh_dtype) for e in sorted(self.own)},
            {"round": outer_round + 1, "experts": sorted(self.own)})
        missing = {e: [p for p in holders[e] if p != me] for e in range(self.n_experts) if e not in self.own}
        await self._refresh({e: hs for e, hs in missing.items() if hs}, outer_round + 1, report)
        report.seconds = round(time.perf_counter() - started, 3)
        return report

    async def _refresh(self, missing: dict[int, list[str]], want_round: int, report: SparseSyncReport) -> None:
        """Replace each untrained expert by a holder's synced copy; fewest downloads first (a holder that has
        several of the missing experts serves them in one answer)."""
        deadline = time.monotonic() + self.refresh_timeout_s
        while missing and time.monotonic() < deadline:
            coverage: dict[str, list[int]] = {}
            for e, hs in missing.items():
                for p in hs:
                    coverage.setdefault(p, []).append(e)
            peer = max(sorted(coverage), key=lambda p: len(coverage[p]))
            got = await self._download(peer, want_round, deadline, report)
            if got is None:  # this holder failed: the others may still serve these experts
                for e in coverage[peer]:
                    missing[e].remove(peer)
                missing = {e: hs for e, hs in missing.items() if hs}
                continue
            for e, flat in got.items():
                if e in missing:
                    self.experts[e].load_(self.model, flat)
                    report.refreshed.append(e)
                    del missing[e]
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
