"""Streaming DiLoCo's fragment rounds (Douillard et al. 2025, arXiv 2501.18512, sec. 2.2; ``[diloco] fragments = F``
> 1): the model is F strided fragments (:mod:`protocols.streaming`), each with its own outer state, outer round and
group keys; fragment p syncs after step (p + 1) H/F of each cycle of H steps, and only its theta_local restarts from
its new theta_outer. The worker's outer round is its last fragment's; status records, state snapshots and
checkpoints carry every fragment's round.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple, Optional

import torch

from peerd.config import ConfigError
from peerd.events import RoundDone
from peerd.roles.fragments import Fragment, fragment
from peerd.roles.outer_sync import Refused, RoundFailure, RoundResult
from peerd.worker.catch_up import majority_holders, syncing, workers
from peerd.worker.rounds.base import RoundEnd, RoundStrategy
from protocols.streaming import strided_fragments

logger = logging.getLogger(__name__)


class FragmentStart(NamedTuple):
    """Fragment ``j``'s round as it begins: the run's status records, the live workers' among them, its theta_local
    ((P_j,) fp32 on the host), the step of the cycle it was taken at, its part and outer sync, and what its
    pseudo-gradient weighs: the samples and inner steps since its last successful round."""

    j: int
    records: dict
    live: dict
    local: torch.Tensor
    position: int
    part: Fragment
    sync: Any
    weight: float
    steps: int


class FragmentRounds(RoundStrategy):
    """F fragments, one round each per cycle of H inner steps. ``next_fragment``: the fragment whose round comes at
    the next boundary; ``synced_at``: per fragment, the worker's (samples, steps) totals at its last successful
    round (what its next pseudo-gradient weighs)."""

    local_differs = True  # theta_local of the fragments synced earlier in the cycle has trained on
    heals_forks = False

    def __init__(self, worker):
        super().__init__(worker)
        self.next_fragment = 0
        self.synced_at = [(0, 0)] * len(self.parts)
        self._cycle: Optional[dict] = None  # the current cycle's exchange totals

    def fragments(self) -> list[Fragment]:
        """F strided fragments, with group keys scoped to each. Raises ConfigError if the model has too few
        parameter tensors for F."""
        w = self.worker
        named = list(w.model.named_parameters())
        try:
            groups = strided_fragments([n for n, _ in named], [p.numel() for _, p in named], w.hp.fragments)
        except ValueError as e:
            raise ConfigError(f"[diloco] fragments: {e}", key="fragments", reason=str(e)) from None
        return [fragment(w.model, f"f{p}", names, w.ctx.namespace, w.name) for p, names in enumerate(groups)]

    async def _begin(self, j: int) -> "FragmentStart | RoundEnd":
        """The start of fragment ``j``'s round: catch up with the swarm (the whole state, or this fragment's), take
        its theta_local, sit the round out if it diverged, open the cycle. Returns the :class:`FragmentStart`, or the
        :class:`RoundEnd` that ends the round here."""
        w = self.worker
        records = await w.peer_records()
        live = workers(records)
        if await w.catch_up(live) or await self._catch_up_fragment(j, live):
            return RoundEnd.ADOPTED
        part = self.parts[j]
        local = part.fragment.flatten(w.model)  # (P_j,)
        position = w.steps_since_sync
        if w.sat_out_diverged(part.outer.outer_round, local):
            self.seek(position, j)  # the schedule goes on with the others
            return RoundEnd.SAT_OUT
        self._open_cycle()
        samples_at, steps_at = self.synced_at[j]
        return FragmentStart(j, records, live, local, position, part, self.syncs[j],
                             float(w.samples_total - samples_at), w.steps_total - steps_at)

    async def round(self) -> RoundEnd:
        """The round of the fragment due at this step of the cycle. Only that fragment's theta_local restarts from
        its new theta_outer; the others keep training. A failed fragment round is tried again H/F steps later, its
        local steps kept, before any other fragment: the peers' schedules realign on it, as a failed whole-model
        round is retried with more steps. The cycle's RoundDone (bytes summed over its fragment rounds) is published
        when its last fragment syncs."""
        w = self.worker
        start = await self._begin(self.next_fragment)
        if isinstance(start, RoundEnd):
            return start
        j, part, position, weight, steps = start.j, start.part, start.position, start.weight, start.steps
        r = part.outer.outer_round
        outcome = await start.sync.round(start.local, weight, start.live, syncing(start.records), owned=True)
        if outcome is None:
            return RoundEnd.ABANDONED
        if isinstance(outcome, Refused):
            logger.warning("round %d of fragment %d: %s; adopting the leader's state", r + 1, j, outcome.reason)
            await w.wait_for_round(outcome.outer_round if j == len(self.parts) - 1 else r)
            return RoundEnd.ADOPTED if await w.download_from([outcome.leader]) else RoundEnd.FAILED
        if isinstance(outcome, RoundFailure):
            w.round_failed(r, f"fragment {j}: {outcome.reason}",
                           f"its theta_outer unchanged, keeping its {steps} local steps, retrying it next")
            self.seek(position, j)
            return RoundEnd.FAILED
        assert isinstance(outcome, RoundResult)
        part.reset_to_outer(w.model)
        self.synced_at[j] = (w.samples_total, w.steps_total)
        last = j == len(self.parts) - 1
        self.seek(0 if last else position, 0 if last else j + 1)
        await self._fragment_done(j, outcome.bytes_sent, outcome.bytes_received, outcome.allreduce_s,
                                  outcome.excluded, outcome.attempts, outcome.group_size, weight, steps)
        return RoundEnd.DONE

    def _open_cycle(self) -> None:
        """The cycle's totals start with its first fragment round's exchange."""
        if self._cycle is None:
            self._cycle = dict(started=time.perf_counter(), sent=0, received=0, seconds=0.0, excluded={}, attempts=1,
                               group=0, weight=0.0, steps=0)

    async def _fragment_done(self, j: int, sent: int, received: int, seconds: float, excluded: dict, attempts: int,
                             group_size: int, weight: float, steps: int) -> None:
        """Fragment ``j``'s round succeeded (bytes, seconds, its group): add it to the cycle's totals and publish
        the status; after the cycle's last fragment, count the round, checkpoint, evaluate and publish RoundDone."""
        w = self.worker
        self._open_cycle()  # normally opened at the cycle's first exchange already
        cycle = self._cycle
        cycle["sent"] += sent
        cycle["received"] += received
        cycle["seconds"] += seconds
        cycle["excluded"].update(excluded)
        cycle["attempts"] = max(cycle["attempts"], attempts)
        cycle["group"] = max(cycle["group"], group_size)
        cycle["weight"], cycle["steps"] = weight, steps
        w.stats.bytes_sent += sent
        w.stats.bytes_received += received
        await self.publish_status()
        if j != len(self.parts) - 1:
            return
        cycle, self._cycle = self._cycle, None
        w.stats.rounds_ok += 1
        w.save_checkpoint()
        n = cycle["group"]
        dp_bytes = int(w.hp.inner_steps * 2 * (n - 1) / n * 4 * sum(p.outer.numel for p in self.parts))
        eval_loss = await w.round_eval()
        w.ctx.events.publish(RoundDone(
            w.outer.outer_round, n, cycle["sent"], cycle["received"], round(cycle["seconds"], 3), cycle["excluded"],
            cycle["attempts"], round(time.perf_counter() - cycle["started"], 3), cycle["weight"], cycle["steps"],
            dp_bytes, w.digest(), w.sync.method, eval_loss, w.stats.tokens, **w._units,
        ))

    def seek(self, step_in_cycle: int, next_fragment: int) -> None:
        """Continue the cycle after its step ``step_in_cycle``: ``next_fragment`` syncs after H/F more steps (or at
        the cycle's next boundary, where a download put us mid-stride)."""
        w = self.worker
        w.steps_since_sync = step_in_cycle
        self.next_fragment = next_fragment
        w.round_quota = w.schedule.next_boundary(step_in_cycle)

    async def _catch_up_fragment(self, j: int, live: dict[str, dict]) -> bool:
        """Download the state of a live peer whose fragment ``j`` is at a later round than ours (its round happened
        without us), else, with methods whose members share theta_outer, that of the live peers whose fragment ``j``
        is at our round but holds another theta_outer held by more workers than ours (a fork of that fragment:
        :func:`peerd.worker.catch_up.majority_holders`). True if we adopted a state."""
        w = self.worker
        mine = self.parts[j].outer.outer_round
        others = {p: s for p, s in live.items() if p != w.peer_id and isinstance(s.get("fragment_rounds"), list)
                  and len(s["fragment_rounds"]) == len(self.parts)}
        ahead = sorted(((s["fragment_rounds"][j], p) for p, s in others.items() if s["fragment_rounds"][j] > mine),
                       reverse=True)
        sources = [p for _, p in ahead]
        if not sources and w.sync.same_theta:
            sources = majority_holders(self.parts[j].outer.digest()[:16], (
                (p, s["fragment_digests"][j]) for p, s in others.items() if s["fragment_rounds"][j] == mine
                and isinstance(s.get("fragment_digests"), list) and len(s["fragment_digests"]) == len(self.parts)))
            if sources:
                logger.warning("fragment %d forked at round %d: %d live peer(s) hold another theta_outer than ours; "
                               "adopting theirs", j, mine, len(sources))
        return bool(sources) and await w.download_from(sources)

    def restarted(self) -> None:
        w = self.worker
        self.synced_at = [(w.samples_total, w.steps_total)] * len(self.parts)
        self._cycle = None
        self.next_fragment = 0

    def adopted(self) -> None:
        # the fragments the adopted state synced this cycle tell where in the cycle it is
        synced = sum(1 for p in self.parts if p.outer.outer_round > self.worker.outer.outer_round)
        self.seek(synced * self.worker.schedule.stride, synced)

    def joined(self, steps_done: int) -> None:
        # into the cycle, before the next fragment boundary the adopted state has not synced
        w = self.worker
        w.steps_since_sync = min(max(steps_done, w.steps_since_sync), w.round_quota - 1)

    def checkpoint_metadata(self) -> dict:
        # each fragment's round, and the (samples, steps) it has not synced yet
        w = self.worker
        return {"fragment_rounds": w.fragment_rounds(),
                "fragment_pending": [[w.samples_total - a, w.steps_total - b] for a, b in self.synced_at]}

    def resume(self, metadata: dict) -> None:
        w = self.worker
        w.samples_total, w.steps_total = 0, 0
        self.synced_at = [(-int(a), -int(b)) for a, b in metadata["fragment_pending"]]
