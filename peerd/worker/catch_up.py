"""Catching up with the swarm: reading the live workers' status records, downloading the state of a peer ahead (or
of the majority of a forked round), and serving ours to joiners.

While it downloads, a worker's status says ``role = "syncing"``, and the all-reduce peers count it in their round's
expected group size: they wait for it in matchmaking (bounded by ``matchmaking_timeout_s``) instead of sealing the
round without it. Otherwise a peer whose download takes longer than a round would find the swarm a round further
every time it finished, and download again forever.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, Iterable, Optional, Sequence

import torch

from peerd.events import StateDownloaded
from protocols.diloco import OuterState
from protocols.state_transfer import StateSnapshot
from protocols.wire import ProtocolViolation

logger = logging.getLogger(__name__)

#: Status role of a worker downloading the swarm's state: it joins the round in progress right after.
SYNCING = "syncing"
#: Status role of a training DiLoCo worker.
TRAINING = "diloco"


class CatchUp:
    """Part of :class:`peerd.worker.outer_worker.OuterWorker`: status records, state download and serving."""

    async def peer_records(self) -> dict[str, dict]:
        """Status records of this run's peers, any role (PeerID -> record)."""
        return await self.ctx.status.records()

    async def live_peers(self) -> dict[str, dict]:
        """Status records of live, training workers of this run (role ``diloco``; PeerID -> record)."""
        return workers(await self.peer_records())

    async def catch_up(self, live: dict[str, dict], margin: int = 1, heal_fork: bool = False) -> bool:
        """Download the state of the most advanced live peer if it is ``margin`` or more rounds ahead of us; with
        ``heal_fork``, else that of the live workers at our round whose theta_outer differs from ours and is held by
        more workers than ours (:meth:`fork_majority`). True if we adopted a state."""
        mine = self.outer.outer_round
        ahead = sorted(
            ((s["outer_round"], p) for p, s in live.items() if p != self.peer_id and s["outer_round"] >= mine + margin),
            reverse=True,
        )
        sources = [p for _, p in ahead] or (self.fork_majority(live) if heal_fork else [])
        if not sources:
            self.align_with_round(live)
            return False
        adopted = await self.download_from(sources)
        if adopted:
            # join the round in progress: do only what the others still have to do
            now, tokens_per_step = time.time(), self.run_cfg.batch_size * self.run_cfg.seq_len
            in_round = [steps_done_now(s, now, tokens_per_step, self.hp.inner_steps, self.ctx.node.status_interval_s)
                        for s in live.values() if s["outer_round"] == self.outer.outer_round]
            self.rounds.joined(max(in_round, default=0))
        return adopted

    def align_with_round(self, live: dict[str, dict]) -> None:
        """Before our first step of a round (a fresh start, a resume, the end of a pause), with live workers at our
        outer round already some steps into it: train only what they still have to do, so that we reach the round's
        rendezvous with them (hivemind's optimizer likewise lets a joiner add its samples to the epoch in progress).

        Before, a joiner that started while the run's creator was in round 0 trained a whole round (40 steps) from
        theta_0 while the creator's round sealed without it, and dropped them all to adopt the creator's state.
        If they have finished their steps (they are at the rendezvous), one step: we meet them there if their group
        is still open, else we are told the round went on (:class:`LeftOut`) and lose one step, not a round.
        Called again after the join's evaluation (the peers trained on meanwhile); it never raises the quota."""
        if self.steps_since_sync or len(self.parts) > 1:
            return
        now, tokens_per_step = time.time(), self.run_cfg.batch_size * self.run_cfg.seq_len
        in_round = [steps_done_now(s, now, tokens_per_step, self.hp.inner_steps, self.ctx.node.status_interval_s)
                    for p, s in live.items() if p != self.peer_id and s["outer_round"] == self.outer.outer_round]
        steps = max(in_round, default=0)
        if not steps or max(1, self.hp.inner_steps - steps) >= self.round_quota:
            return  # nobody is into the round, or no further than we counted before (an older record)
        self.rounds.joined(steps)
        logger.info("joining round %d in progress: live peers are %d of %d inner steps into it; training the %d "
                    "left", self.outer.outer_round + 1, steps, self.hp.inner_steps, self.round_quota)

    def fork_majority(self, live: dict[str, dict]) -> list[str]:
        """The live workers at our outer round that hold the theta_outer (status ``digest``) most workers at that
        round hold, ours counted, when it is not ours (ties: the larger digest, so that every worker picks the same);
        [] otherwise, and for methods (or round strategies) whose members need not share theta_outer.

        Two groups of one round sealed apart (a latecomer's DHT reads missed the first group's records: 61 workers in
        one group, 2 in another) fork theta_outer under the same round numbers; their members never meet in one
        group again (the two reach each boundary at different times), so the fork lasted to the end of the run."""
        if not self.sync.same_theta or not self.rounds.heals_forks:
            return []
        return majority_holders(self.digest()[:16], ((peer, status.get("digest")) for peer, status in live.items()
                                                     if peer != self.peer_id
                                                     and status["outer_round"] == self.outer.outer_round))

    async def wait_for_round(self, outer_round: int) -> None:
        """Wait (bounded by the round's timeouts) until a live worker's status shows ``outer_round``: the group of
        the leader that refused us (or sealed without us) is finishing that round right now, and its state after the
        round is the one worth adopting. The leader's record missing from our view does not end the wait: on a loaded
        DHT records go missing for seconds, and a peer that stopped waiting then found nobody ahead, failed its round
        and trained the next one on the stale state (a third of 64 workers on one machine, in each of two rounds)."""
        loop = asyncio.get_running_loop()
        averaging = self.run_cfg.averaging
        deadline = loop.time() + averaging.matchmaking().max_wait + averaging.allreduce().reducer_timeout_s
        while loop.time() < deadline and not self.ctx.stop.is_set():
            if any(s["outer_round"] >= outer_round for p, s in (await self.live_peers()).items() if p != self.peer_id):
                return
            await asyncio.sleep(min(1.0, self.ctx.node.status_interval_s))

    async def download_from(self, peers: list[str]) -> bool:
        """Adopt the outer state of the first of ``peers`` that serves a valid one; False if none did. Our status
        says SYNCING meanwhile, so that peers ahead wait for us in their round."""
        self.syncing = True
        await self.ctx.status.publish()
        try:
            return await self.download_first(peers)
        finally:
            self.syncing = False

    async def download_first(self, peers: list[str]) -> bool:
        """Adopt the first valid state of ``peers`` (theta_outer, momentum and every fragment's round); the local
        steps and any round in flight are dropped. Publishes :class:`peerd.events.StateDownloaded`. True if
        adopted."""
        got = await self.state_sync.download_first(peers, 2 * 4 * self._numel(), self._validate)
        if got is None:
            return False
        dropped = self.steps_since_sync
        self.rounds.drop()
        self.restart_local(got.state)
        self.rounds.adopted()
        self.syncing = False
        await self.ctx.status.publish()
        self.ctx.events.publish(StateDownloaded(self.outer.outer_round, got.peer, self.digest(), got.seconds,
                                                got.payload_bytes / 1e6, dropped))
        return True

    def _numel(self) -> int:
        return sum(p.outer.numel for p in self.parts)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """(P,) of all fragments, concatenated in fragment order -> one (P_j,) view per fragment."""
        return list(torch.split(flat, [p.outer.numel for p in self.parts]))

    def _outer_states(self, theta: torch.Tensor, momentum: torch.Tensor, rounds: list) -> list[OuterState]:
        """Per-fragment outer states from the concatenated (P,) tensors and the fragments' rounds."""
        if not isinstance(rounds, list) or len(rounds) != len(self.parts):
            raise ValueError(f"expected {len(self.parts)} fragment rounds, got {rounds!r}")
        return [OuterState(t.clone(), m.clone(), int(r))
                for t, m, r in zip(self._split(theta), self._split(momentum), rounds)]

    def _validate(self, snapshot: StateSnapshot) -> list[OuterState]:
        numel = self._numel()
        tensors = snapshot.tensors({"theta": (torch.float32, numel), "momentum": (torch.float32, numel)})
        meta = snapshot.metadata
        rounds = meta.get("fragment_rounds") if len(self.parts) > 1 else [int(meta.get("outer_round", -1))]
        outers = self._outer_states(tensors["theta"], tensors["momentum"], rounds)
        digest = state_digest([o.digest() for o in outers])
        if meta.get("digest") != digest:
            raise ProtocolViolation("state digest does not match its tensors")
        return outers

    def current_snapshot(self) -> StateSnapshot:
        """The outer state as served to joiners, rebuilt only when a fragment's state object changed."""
        outers = tuple(p.outer for p in self.parts)
        if self._snapshot is None or self._snapshot_of is None or any(
                a is not b for a, b in zip(outers, self._snapshot_of)):
            self._snapshot_of = outers
            metadata = {"outer_round": self.outer.outer_round, "digest": self.digest(),
                        "run": self.run_cfg.fingerprint()}
            if len(outers) > 1:
                metadata["fragment_rounds"] = [o.outer_round for o in outers]
            self._snapshot = StateSnapshot.from_tensors(
                {"theta": self._cat("theta"), "momentum": self._cat("momentum")}, metadata)
        return self._snapshot

    def _cat(self, attr: str) -> torch.Tensor:
        """theta or momentum of every fragment, concatenated in fragment order ((P,) fp32)."""
        if len(self.parts) == 1:
            return getattr(self.outer, attr)
        return torch.cat([getattr(p.outer, attr) for p in self.parts])

    def digest(self) -> str:
        """theta_outer's digest: the whole model's (one fragment), else the SHA-256 of the fragments' digests."""
        return state_digest([p.outer.digest() for p in self.parts])

    def known_digest(self) -> Optional[str]:
        """:meth:`digest` if every fragment's is computed already (a round's new state is hashed in a worker thread
        while training goes on), else None; never computes one on the event loop."""
        known = [p.outer.known_digest for p in self.parts]
        return None if None in known else state_digest(known)

    def fragment_rounds(self) -> list[int]:
        """Each fragment's outer round, in fragment order."""
        return [p.outer.outer_round for p in self.parts]

    def fragment_digests(self) -> list[str]:
        """Each fragment's theta_outer digest (its first 16 hex characters, as status records carry), in fragment
        order."""
        return [p.outer.digest()[:16] for p in self.parts]


def state_digest(fragment_digests: Sequence[str]) -> str:
    """The digest of a worker's whole outer state from its fragments' :meth:`OuterState.digest` (hex), in fragment
    order: the one fragment's own, else the SHA-256 (hex) of them joined by ``|``."""
    if len(fragment_digests) == 1:
        return fragment_digests[0]
    return hashlib.sha256("|".join(fragment_digests).encode()).hexdigest()


def majority_holders(own: str, others: Iterable[tuple[str, Any]]) -> list[str]:
    """The peers holding the digest most holders hold, ``own`` (this peer's) counted once, when it is not ``own``
    (ties: the larger digest, so that every peer picks the same); [] otherwise. ``others``: (PeerID, digest) of the
    peers at the same round; a digest that is not a string is left out."""
    holders: dict[str, list[str]] = {}
    for peer, digest in others:
        if isinstance(digest, str) and digest:
            holders.setdefault(digest, []).append(peer)
    counts = {digest: len(peers) for digest, peers in holders.items()}
    counts[own] = counts.get(own, 0) + 1
    best = max(counts, key=lambda digest: (counts[digest], digest))
    return [] if best == own else holders[best]


def steps_done_now(record: dict, now: float, tokens_per_step: int, inner_steps: int, fresh_s: float = 0.0) -> int:
    """A live worker's inner steps in its current round at wall-clock time ``now`` (seconds since the epoch): its
    status record's ``inner_step`` plus the steps its ``tokens_per_s`` gives for the record's age (``now`` - its
    ``time``) beyond ``fresh_s`` (the publication interval: a record younger than that is as fresh as records get,
    and its worker may have spent the time evaluating or matchmaking), at most ``inner_steps``. A record read from a
    loaded DHT can be a minute old: a joiner that trusted its ``inner_step`` (3 of 20 where the others were at 18)
    trained 17 steps while they sealed the next round without it, and fell a round behind again."""
    steps = record.get("inner_step") or 0
    rate, published = record.get("tokens_per_s"), record.get("time")
    if isinstance(rate, (int, float)) and rate > 0 and isinstance(published, (int, float)) and tokens_per_step > 0:
        steps += int(max(0.0, now - published - fresh_s) * rate / tokens_per_step)
    return min(steps, inner_steps)


def syncing(records: dict[str, dict]) -> frozenset[str]:
    """The peers whose status records say they are downloading the state (to join the round)."""
    return frozenset(peer for peer, value in records.items() if value.get("role") == SYNCING)


def workers(records: dict[str, dict]) -> dict[str, dict]:
    """The records of training workers (role ``diloco`` with an outer round) among status records."""
    return {peer: value for peer, value in records.items()
            if value.get("role") == TRAINING and isinstance(value.get("outer_round"), int)}
