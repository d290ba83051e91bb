"""Streaming DiLoCo with both of its parts (Douillard et al. 2025, arXiv 2501.18512, sec. 2.2 and 2.3;
``[diloco] fragments = F`` > 1 and ``overlap = "delayed"``): F strided fragments on the fragment schedule
(:mod:`peerd.worker.rounds.fragments`), each fragment's all-reduce overlapped with the next inner steps
(:class:`protocols.diloco.DelayedOuterStep`).

At fragment j's boundary the worker sends fragment j's pseudo-gradient (its theta_outer - theta_local) to a
background all-reduce and trains on; as soon as the average arrives (between two inner steps) fragment j's
theta_outer takes its outer step and its theta_local merges with it (``overlap_mix``). An exchange may run until the
next fragment's boundary (H/F inner steps later): there compute waits for it before the next fragment is sent, so
at most one exchange is in flight and the peers' fragment rounds stay comparable at every boundary (catch-up reads
them). A fragment whose background round failed keeps theta_outer and theta_local unmerged; its next round, one cycle
later, sends every step since theta_outer last moved, weighted by all their samples. The cycle's RoundDone is
published when its last fragment's average lands.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import torch

from peerd.roles.outer_sync import Refused, RoundFailure
from peerd.worker.catch_up import syncing
from peerd.worker.rounds.base import LandsInFlight, RoundEnd
from peerd.worker.rounds.fragments import FragmentRounds
from protocols.diloco import DelayedOuterStep

logger = logging.getLogger(__name__)


class DelayedFragmentRounds(LandsInFlight, FragmentRounds):
    """F fragments, each fragment's exchange overlapped with the next H/F inner steps. ``in_flight``: the fragment
    whose exchange runs in the background and its task (returning ``(outcome, weight, steps, started, stepped)``,
    ``stepped`` from :meth:`step_off_loop`), or None."""

    def __init__(self, worker):
        super().__init__(worker)
        self.in_flight: Optional[tuple[int, asyncio.Task]] = None
        self._unsent: Optional[tuple[int, int]] = None  # the in-flight fragment's synced_at before it was sent

    async def round(self) -> RoundEnd:
        """Fragment boundary: land the previous fragment's exchange (compute waits only if it is still running),
        then send this fragment's pseudo-gradient to a background all-reduce and train on."""
        w = self.worker
        if self.in_flight is not None:
            landed = await self.land()
            if landed == RoundEnd.ADOPTED or w.finished():
                return landed
        start = await self._begin(self.next_fragment)
        if isinstance(start, RoundEnd):
            return start
        j, records = start.j, start.records
        delta = DelayedOuterStep(start.part.outer).boundary(start.local)  # every step since theta_outer last moved
        self._unsent = self.synced_at[j]
        # the last group's members without a status record now are expected too (see DelayedRounds)
        lapsed = start.sync.last_members - records.keys() - {w.peer_id}
        task = asyncio.ensure_future(self._exchange(j, delta, start.weight, start.steps, start.live,
                                                    syncing(records) | lapsed))
        self.in_flight = (j, task)
        self.synced_at[j] = (w.samples_total, w.steps_total)  # back to _unsent if the round fails
        last = j == len(self.parts) - 1
        self.seek(0 if last else start.position, 0 if last else j + 1)
        # the checkpoint is written once a cycle, when its last fragment lands (_fragment_done), not at each of its
        # F boundaries: each write copies the whole state while no inner step runs
        self.publish_soon()
        return RoundEnd.SENT

    async def _exchange(self, j: int, delta: torch.Tensor, weight: float, steps: int, live: dict,
                        expected: frozenset[str]):
        started = time.perf_counter()
        outer = self.parts[j].outer
        outcome = await self.syncs[j].exchange(delta, weight, live, expected, also_expect=(outer.outer_round - 1,))
        return outcome, weight, steps, started, await self.step_off_loop(outer, outcome)

    async def between_steps(self) -> bool:
        if self.in_flight is None or not self.in_flight[1].done():
            return False
        await self.land()
        return self.worker.finished()

    async def land(self) -> RoundEnd:
        """Wait for the exchange in flight and land it: DONE (its fragment's theta_outer took the outer step, its
        theta_local merged), FAILED (unchanged; its samples count in its next round) or ADOPTED."""
        w = self.worker
        (j, task), self.in_flight = self.in_flight, None
        outcome, weight, steps, started, stepped = await task
        part = self.parts[j]
        r = part.outer.outer_round
        if isinstance(outcome, Refused):
            logger.warning("round %d of fragment %d: %s; adopting the leader's state", r + 1, j, outcome.reason)
            await w.wait_for_round(outcome.outer_round if j == len(self.parts) - 1 else r)
            await w.download_from([outcome.leader])
            return RoundEnd.ADOPTED
        if not isinstance(outcome, tuple):  # a failure, or abandoned by a pause or stop
            reason = outcome.reason if isinstance(outcome, RoundFailure) else "abandoned (pause or stop)"
            w.round_failed(r, f"fragment {j}: {reason}",
                           f"its theta_outer unchanged, carrying its {steps} local steps into its next round")
            self.synced_at[j] = self._unsent
            return RoundEnd.FAILED
        result, attempts = outcome
        step = self.landed_step(part.outer, stepped, result.averaged)
        part.outer = step.state
        finished = w.finished()
        if not finished:
            part.fragment.load_(w.model, step.merge(part.fragment.flatten(w.model), w.hp))
        await self._fragment_done(j, result.bytes_sent, result.bytes_received, result.seconds, result.excluded,
                                  attempts, result.group_size, weight, steps)
        if finished:  # the run's last outer step: the model is theta_outer
            w.restart_local()
        return RoundEnd.DONE

    def drop(self) -> None:
        if self.in_flight is not None:
            self.in_flight[1].cancel()
            self.in_flight = None

