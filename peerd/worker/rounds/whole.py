"""Whole-model rounds (DiLoCo, Douillard et al. 2023, Alg. 1): every H inner steps the whole model's
pseudo-gradient meets the swarm's through the run's outer sync; on success theta_local restarts from theta_outer.

When a round fails (no group in time, too few peers, a reducer died, the leader refused our state), theta_outer and
the outer momentum stay exactly as they were, and theta_local is *not* reset: the worker keeps training, and its
next pseudo-gradient covers every step since the last successful round (its weight counts all those samples). If the
others completed the round without us, the status records show a later round and the worker downloads that state
before its next attempt, dropping its unsynchronized local steps. A leader that sees a member with a different
theta_outer digest refuses it; the refused worker downloads the leader's state. So no two members of a group ever
disagree on theta_outer.

A peer that still reaches the rendezvous after its group sealed without it (no member's view had its record) is told
so by the sealer (:class:`peerd.roles.outer_sync.LeftOut`) and waits until some live worker has finished that round
and adopts its state (its steps carried with ``straggler = "carry"``), so it trains the next round with the others;
being left out counts no failed try (a fresh group key would gather the latecomers into a rival group). It used to
train a further round on the stale state (missing that round too), or, with the smallest PeerID, average alone after
a matchmaking window, forking theta_outer and staying that window behind in every later round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Callable, Optional

import torch

from peerd.events import RoundDone
from peerd.roles.outer_sync import LeftOut, Refused, RoundFailure, RoundResult
from peerd.worker.catch_up import syncing, workers
from peerd.worker.rounds.base import RoundEnd, RoundStrategy
from protocols.codecs import all_finite

logger = logging.getLogger(__name__)


class WholeModelRounds(RoundStrategy):
    """The whole model syncs at each boundary of H inner steps.

    The new theta_outer's digest (a SHA-256 of 8P bytes: ~0.8 s for the 125m preset at 1.2 GB/s, ~8 s for 1.1b)
    is not on the round's path: the round returns once theta_local restarted from theta_outer (and the evaluation
    the round waits for, if any, is done), and the digest is computed in a worker thread while the inner steps go
    on; the status record with the new round and its :class:`peerd.events.RoundDone` follow once it is known (the
    next round waits for them). Nothing else needs it before the next boundary: the digest goes with the next
    round's group info and into the status records peers compare to find forks."""

    _announcing: Optional[asyncio.Future] = None

    async def round(self) -> RoundEnd:
        await self.settled()  # the last round's status record and RoundDone first
        w = self.worker
        sync = w.sync
        records = await w.peer_records()
        live = workers(records)
        margin = sync.catch_up_margin
        if margin is not None:
            carry = self._straggler_carry()
            if await w.catch_up(live, margin, heal_fork=True):
                self._apply_straggler_carry(carry)
                return RoundEnd.ADOPTED
        started = time.perf_counter()
        r = w.outer.outer_round
        local = w.part.fragment.flatten(w.model)  # (P,)
        if w.sat_out_diverged(r, local):
            return RoundEnd.SAT_OUT
        weight = float(w.samples_since_sync)
        steps = w.steps_since_sync
        # a fresh copy: reused for the pseudo-gradient, the average and the new theta_outer; the model stands
        # still until the round returns, so a failed attempt can take theta_local from it again
        outcome = await sync.round(local, weight, live, syncing(records), owned=True, digest=False,
                                   retake_local=lambda: w.part.fragment.flatten(w.model))
        if outcome is None:
            return RoundEnd.ABANDONED
        if isinstance(outcome, Refused):
            logger.warning("round %d: %s; adopting the leader's state after its round", r + 1, outcome.reason)
            await w.wait_for_round(outcome.outer_round)
            return RoundEnd.ADOPTED if await w.download_from([outcome.leader]) else RoundEnd.FAILED
        if isinstance(outcome, LeftOut) and await self._rejoin(r, outcome):
            return RoundEnd.ADOPTED
        if isinstance(outcome, RoundFailure):
            w.round_failed(r, outcome.reason, f"theta_outer unchanged, keeping {steps} local steps")
            w.round_quota = steps + w.hp.inner_steps
            return RoundEnd.FAILED
        assert isinstance(outcome, RoundResult)
        if outcome.failure is not None:
            w.round_failed(r, outcome.failure, "keeping our own outer step")
        await w.restart_local_off_loop()
        w.stats.rounds_ok += 1
        w.stats.bytes_sent += outcome.bytes_sent
        w.stats.bytes_received += outcome.bytes_received
        w.save_checkpoint()
        outer = w.outer
        digest = asyncio.get_running_loop().run_in_executor(None, outer.digest)
        # before the evaluation: peers count on us in the next round from now
        status = asyncio.ensure_future(self._publish_status_after(digest))
        n = outcome.group_size
        dp_bytes = int(steps * 2 * (n - 1) / n * 4 * outer.numel)
        eval_loss = await w.round_eval()
        round_s, tokens, units = round(time.perf_counter() - started, 3), w.stats.tokens, dict(w._units)

        def event(digest: str) -> RoundDone:
            return RoundDone(outer.outer_round, n, outcome.bytes_sent, outcome.bytes_received, outcome.allreduce_s,
                             outcome.excluded, outcome.attempts, round_s, weight, steps, dp_bytes, digest,
                             sync.method, eval_loss, tokens, **units)

        self._announcing = asyncio.ensure_future(self._announce(digest, status, event))
        return RoundEnd.DONE

    async def _publish_status_after(self, digest: asyncio.Future) -> None:
        """The status record of the new round, once theta_outer's digest (which it carries) is known."""
        await digest
        await self.worker.ctx.status.publish()

    async def _announce(self, digest: asyncio.Future, status: asyncio.Future,
                        event: Callable[[str], RoundDone]) -> None:
        """Once theta_outer's digest is known: the status record, then :class:`peerd.events.RoundDone` (its round
        time is the boundary's: taken before the round returned)."""
        await status
        self.worker.ctx.events.publish(event(await digest))

    async def settled(self) -> None:
        """Wait for the last round's status record and RoundDone (at once if they went out)."""
        if self._announcing is not None:
            announcing, self._announcing = self._announcing, None
            await announcing

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # boundary: leaving; the round's record and event are best effort
            await self.settled()

    async def _rejoin(self, r: int, outcome: LeftOut) -> bool:
        """Round ``r + 1``'s group sealed before we joined it: wait for its leader to finish the round and adopt that
        state now (our local steps carried into the next round with ``straggler = "carry"``), so that we train the
        next round with the others. True if we adopted a state.

        Before, such a peer trained a whole further round on its stale state and the others, not counting a peer a
        round behind, sealed that round without it too; and one with the smallest PeerID averaged alone after an
        idle window, then reached every later boundary that window after the others and missed every later group."""
        w = self.worker
        carry, steps = self._straggler_carry(), w.steps_since_sync
        await w.wait_for_round(outcome.outer_round)
        if not await w.catch_up(await w.live_peers()):
            return False
        w.round_failed(r, outcome.reason, "adopted the state of the round that went on without us, "
                       + ("carrying" if carry is not None else "dropping") + f" our {steps} local steps")
        self._apply_straggler_carry(carry)
        return True

    def _straggler_carry(self) -> Optional[tuple[int, torch.Tensor, int]]:
        """With ``straggler = "carry"``: (our outer round, pseudo-gradient (P,) against our theta_outer, samples)
        before a possible catch-up; None otherwise (or with nothing worth carrying)."""
        w = self.worker
        if w.hp.straggler != "carry" or not w.samples_since_sync or w.sync.method != "allreduce":
            return None
        delta = w.outer.pseudo_gradient(w.part.fragment.flatten(w.model))  # (P,)
        return (w.outer.outer_round, delta, w.samples_since_sync) if all_finite(delta) else None

    def _apply_straggler_carry(self, carry: Optional[tuple[int, torch.Tensor, int]]) -> None:
        """After adopting the state of the swarm one round ahead: theta_local := theta_outer - delta, so the next
        pseudo-gradient holds our missed round's steps too, and its weight their samples."""
        if carry is None:
            return
        w = self.worker
        r, delta, samples = carry
        if w.outer.outer_round != r + 1:  # further ahead: too stale to add to the next round
            return
        w.part.fragment.load_(w.model, w.outer.theta - delta)
        w.samples_since_sync += samples
        logger.info("round %d went on without us: carrying our pseudo-gradient (%d samples) into round %d",
                    r + 1, samples, r + 2)
