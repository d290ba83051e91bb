"""Delayed outer rounds (``[diloco] overlap = "delayed"``; :class:`protocols.diloco.DelayedOuterStep`, Streaming
DiLoCo's overlap): the all-reduce of round r runs in the background while round r+1's inner steps go on from
theta_local.

At a round boundary the worker sends its pseudo-gradient (theta_outer - theta_local) and keeps training; between two
inner steps, as soon as the all-reduce has finished, it applies the average to theta_outer and merges theta_local
with it (``overlap_mix``). Compute waits only when an all-reduce outlasts a whole round. Every peer applies the same
averages to the same state, so theta_outer stays bit-identical. A background round that fails leaves theta_outer
unchanged and theta_local unmerged, so the next pseudo-gradient covers its steps too (weighted by all their
samples); a worker that adopts another peer's state drops both its round in flight and that carry. The model
evaluated is theta_outer. On stop the round in flight is finished (bounded) and applied before the final checkpoint.

The delayed overlap also expects the last group's members whose status records lapsed: a leader that missed one
record sealed every member's round into failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import torch

from peerd.events import RoundDone
from peerd.roles.outer_sync import Refused, RoundFailure
from peerd.worker.catch_up import syncing, workers
from peerd.worker.rounds.base import LandsInFlight, RoundEnd, RoundStrategy
from protocols.diloco import DelayedOuterStep

logger = logging.getLogger(__name__)


class DelayedRounds(LandsInFlight, RoundStrategy):
    """The whole model, its all-reduce overlapped with the next round's inner steps. ``in_flight``: the background
    all-reduce (a task returning ``(outcome, delta, weight, steps, started, stepped)``, ``stepped`` from
    :meth:`step_off_loop`), or None; ``carry``: a failed
    background round's (samples, steps), added to the next round's weight."""

    local_differs = True  # theta_local never restarts from theta_outer

    def __init__(self, worker):
        super().__init__(worker)
        self.in_flight: Optional[asyncio.Task] = None
        self.carry: Optional[tuple[float, int]] = None

    async def round(self) -> RoundEnd:
        """Round boundary: send this round's pseudo-gradient to a background all-reduce and train on from
        theta_local (SENT; ADOPTED or, after the run's last round, DONE where the previous round still in flight
        landed here)."""
        w = self.worker
        if self.in_flight is not None:  # the last exchange outlasted this round's inner steps: compute waits here
            landed = await self.land()
            if landed == RoundEnd.ADOPTED or w.finished():
                return landed
        r = w.outer.outer_round
        local = w.part.fragment.flatten(w.model)  # (P,)
        if w.sat_out_diverged(r, local):
            return RoundEnd.SAT_OUT
        delta = DelayedOuterStep(w.outer).boundary(local)  # every step since theta_outer last moved
        weight, steps = float(w.samples_since_sync), w.steps_since_sync
        if self.carry is not None:  # a failed round's samples: theta_outer did not move, delta already holds them
            carried_weight, carried_steps = self.carry
            weight, steps = weight + carried_weight, steps + carried_steps
            self.carry = None
        records = await w.peer_records()
        live = workers(records)
        if await w.catch_up(live, w.sync.catch_up_margin or 1, heal_fork=True):
            return RoundEnd.ADOPTED
        # the last group's members without any status record now: on a loaded machine a record can lapse between two
        # publications, and a leader that did not count such a peer sealed the group without it. Waiting for one
        # that died costs an idle window of the background matchmaking, not compute
        lapsed = w.sync.last_members - records.keys() - {w.peer_id}
        self.in_flight = asyncio.ensure_future(
            self._exchange(delta, weight, steps, live, syncing(records) | lapsed))
        w.steps_since_sync, w.samples_since_sync = 0, 0  # theta_local goes on: no restart
        w.round_quota = w.schedule.stride
        w.save_checkpoint()
        self.publish_soon()  # peers count on us in the next round from now
        return RoundEnd.SENT

    async def between_steps(self) -> bool:
        """Land the background all-reduce if it has finished. True if training should stop (the last round of
        ``max_outer_rounds`` landed)."""
        if self.in_flight is None or not self.in_flight.done():
            return False
        await self.land()
        return self.worker.finished()

    async def _exchange(self, delta: torch.Tensor, weight: float, steps: int, live: dict, expected: frozenset[str]):
        """All-reduce ``delta`` (P,) for the round after theta_outer; ``(outcome, delta, weight, steps, started)``.
        Peers still at the previous round (not at their boundary yet) are expected too."""
        started = time.perf_counter()
        outer = self.worker.outer
        outcome = await self.worker.sync.exchange(delta, weight, live, expected, also_expect=(outer.outer_round - 1,))
        return outcome, delta, weight, steps, started, await self.step_off_loop(outer, outcome)

    async def land(self) -> RoundEnd:
        """Wait for the background all-reduce and land it: DONE (theta_outer took its outer step, theta_local
        merged with it, RoundDone published), FAILED (theta_outer unchanged, its samples carried into the next
        round's weight) or ADOPTED (refused: we took the leader's state)."""
        w = self.worker
        task, self.in_flight = self.in_flight, None
        outcome, delta, weight, steps, started, stepped = await task
        r = w.outer.outer_round
        if isinstance(outcome, Refused):
            logger.warning("round %d: %s; adopting the leader's state after its round", r + 1, outcome.reason)
            await w.wait_for_round(outcome.outer_round)
            await w.download_from([outcome.leader])
            return RoundEnd.ADOPTED
        if not isinstance(outcome, tuple):  # a failure, or abandoned by a pause or stop
            reason = outcome.reason if isinstance(outcome, RoundFailure) else "abandoned (pause or stop)"
            w.round_failed(r, reason, f"theta_outer unchanged, carrying {steps} local steps into the next round")
            self.carry = (weight, steps)
            return RoundEnd.FAILED
        result, attempts = outcome
        step = self.landed_step(w.outer, stepped, result.averaged)
        w.outer = step.state
        if w.finished():  # the run's last outer step: the model is theta_outer
            w.restart_local()
        else:
            w.part.fragment.load_(w.model, step.merge(w.part.fragment.flatten(w.model), w.hp))
        w.stats.rounds_ok += 1
        w.stats.bytes_sent += result.bytes_sent
        w.stats.bytes_received += result.bytes_received
        n = result.group_size
        dp_bytes = int(steps * 2 * (n - 1) / n * 4 * w.outer.numel)
        fields = (w.outer.outer_round, n, result.bytes_sent, result.bytes_received, round(result.seconds, 3),
                  result.excluded, attempts, round(time.perf_counter() - started, 3), weight, steps, dp_bytes,
                  w.outer.digest(), w.sync.method)
        self.publish_soon()
        w.ctx.events.publish(RoundDone(*fields, await w.round_eval(), w.stats.tokens, **w._units))
        return RoundEnd.DONE

    def drop(self) -> None:
        self.carry = None
        if self.in_flight is not None:
            self.in_flight.cancel()
            self.in_flight = None

