"""The DiLoCo worker: a model trained by inner steps on local data and synced with the swarm in outer rounds.

:class:`OuterWorker` puts together the worker core (:mod:`peerd.worker.core`), the inner loop
(:mod:`peerd.worker.inner`), catch-up (:mod:`peerd.worker.catch_up`), the checkpoint (:mod:`peerd.worker.checkpointing`)
and the round evaluation (:mod:`peerd.worker.evaluation`) with one round strategy (:mod:`peerd.worker.rounds`),
chosen once from the run config, which owns the model's fragments, their outer states and outer syncs.

Driving it (what the role's :meth:`run` does, and what tests call): ``await worker.train_until_quota()`` then
``await worker.run_round()``, repeatedly.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import torch

from peerd.events import RoundFailed
from peerd.models import build_model
from peerd.roles.base import RunContext
from peerd.roles.outer_sync import RETRIES_FIELD
from peerd.roles.state_sync import StateSync
from peerd.worker.catch_up import SYNCING, TRAINING, CatchUp
from peerd.worker.checkpointing import OuterCheckpoint
from peerd.worker.core import PAUSED, WorkerCore
from peerd.worker.evaluation import RoundEvaluation
from peerd.worker.inner import InnerLoop
from peerd.worker.rounds import RoundEnd, make_rounds
from protocols.codecs import all_finite
from protocols.diloco import OuterState
from protocols.state_transfer import StateSnapshot
from protocols.streaming import FragmentSchedule

logger = logging.getLogger(__name__)


class OuterWorker(InnerLoop, CatchUp, OuterCheckpoint, RoundEvaluation, WorkerCore):
    """One peer's DiLoCo training. ``run()`` returns when stopped or after ``max_outer_rounds``.

    Public state: ``model`` (theta_local), ``parts`` (one :class:`peerd.roles.fragments.FragmentState` per fragment)
    and ``syncs`` (their outer syncs), ``outer`` (the last fragment's outer state: the worker's outer round),
    ``steps_since_sync`` / ``samples_since_sync`` (since theta_local last restarted), ``round_quota`` (the step of
    the next round boundary), ``stats``, ``rounds`` (the round strategy)."""

    name = TRAINING

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        run = ctx.run
        self.syncing = False
        self.model = build_model(run.model, run.seq_len, run.seed, ctx.tokenizer.vocab_size).to(self.device)
        self._setup_inner_step(ctx.node)
        self.steps_since_sync = 0
        self.samples_since_sync = 0
        self.steps_total, self.samples_total = 0, 0  # every inner step this process trained
        self.schedule = FragmentSchedule(self.hp.inner_steps, self.hp.fragments)
        self.round_quota = self.schedule.stride
        self.rounds = make_rounds(self)
        self._snapshot: Optional[StateSnapshot] = None
        self._snapshot_of: Optional[tuple] = None
        self.state_sync = StateSync(ctx.transport, ctx.namespace.prefix(TRAINING), self.current_snapshot,
                                    run.averaging.state_transfer().download_timeout_s)
        self.components = (*self.syncs, self.state_sync)
        self._start_writer()

    @property
    def parts(self) -> list:
        return self.rounds.parts

    @property
    def syncs(self) -> list:
        return self.rounds.syncs

    @property
    def part(self):
        """The last fragment (the whole model with one): it syncs at the end of each cycle of H steps."""
        return self.parts[-1]

    @property
    def sync(self):
        return self.syncs[-1]

    @property
    def outer(self) -> OuterState:
        return self.part.outer

    @outer.setter
    def outer(self, value: OuterState) -> None:
        self.part.outer = value

    @property
    def outer_round(self) -> int:
        return self.outer.outer_round

    # ----------------------------------------------------------------------------------------------------- the loop

    async def join(self) -> None:
        await self.catch_up(await self.live_peers())
        if self.ctx.stop.is_set():  # Ctrl-C while joining: leave now, not after a full evaluation
            return
        await self.evaluate_and_publish()
        if not self.ctx.stop.is_set():
            # the live peers trained on while we evaluated (seconds on a loaded CPU): count their steps again, or we
            # come to their rendezvous that much later than they do
            self.align_with_round(await self.live_peers())

    async def run_round(self) -> RoundEnd:
        """One outer round (or fragment round) with the run's round strategy (:mod:`peerd.worker.rounds`); returns
        how it ended, once the round's status record and events went out."""
        end = await self.rounds.round()
        await self.rounds.settled()
        return end

    async def boundary_round(self) -> RoundEnd:
        """:meth:`run_round` as the training loop runs it: returns as soon as training may go on (what the round
        publishes after that, :meth:`peerd.worker.rounds.RoundStrategy.settled`, goes out meanwhile)."""
        return await self.rounds.round()

    async def _finish_in_flight(self) -> None:
        await self.rounds.close()

    async def _on_resume(self) -> None:
        await self.ctx.status.publish()
        await self.catch_up(await self.live_peers())  # before training: steps on a stale state would be dropped

    # ------------------------------------------------------------------------------------------ what rounds share

    def restart_local(self, outers: Optional[list[OuterState]] = None) -> None:
        """theta_local := theta_outer for every fragment (adopting ``outers`` first if given, one per fragment); the
        next round (cycle) starts from zero steps."""
        self._reset_to_outer(outers)
        self._restarted()

    async def restart_local_off_loop(self) -> None:
        """:meth:`restart_local` with the copy of theta_outer into the model in a worker thread (the training loop
        waits for it): right after a round this peer's last answers may still sit in its transport's buffers
        (TLS takes ~0.6 MB a connection ahead of the wire), and only the event loop moves them on to the members
        that wait for them; the copy takes ~1 s for a billion parameters on a CPU host."""
        await asyncio.get_running_loop().run_in_executor(None, self._reset_to_outer)
        self._restarted()

    def _reset_to_outer(self, outers: Optional[list[OuterState]] = None) -> None:
        for i, part in enumerate(self.parts):
            part.reset_to_outer(self.model, outers[i] if outers is not None else None)

    def _restarted(self) -> None:
        self.steps_since_sync, self.samples_since_sync = 0, 0
        self.round_quota = self.schedule.stride
        self.rounds.restarted()

    def round_failed(self, r: int, reason: str, consequence: str) -> None:
        """Count round ``r + 1`` as failed and publish :class:`peerd.events.RoundFailed`."""
        self.stats.rounds_failed += 1
        self.ctx.events.publish(RoundFailed(r, reason, self.sync.method, consequence))

    def sat_out_diverged(self, r: int, local: torch.Tensor) -> bool:
        """If theta_local ((P,)) is not finite, sit round ``r + 1`` out: nobody can use our contribution (and the
        all-reduce would refuse it); restart from theta_outer with a fresh inner optimizer. True if it did."""
        if all_finite(local):
            return False
        self.round_failed(r, "local pseudo-gradient is not finite (local training diverged)",
                          f"dropping {self.steps_since_sync} local steps and the inner optimizer state, "
                          "restarting from theta_outer")
        self.new_optimizer()
        self.restart_local()
        return True

    # ------------------------------------------------------------------------------------------------------- status

    def status_role(self) -> str:
        return PAUSED if self.ctx.gate.paused else SYNCING if self.syncing else self.name

    def status_fields(self) -> dict:
        retries = {part.fragment.name: tries for part, sync in zip(self.parts, self.syncs)
                   if (tries := sync.retries()) is not None}
        return dict(super().status_fields(),
                    **({"fragment_rounds": self.fragment_rounds(), "fragment_digests": self.fragment_digests()}
                       if len(self.parts) > 1 else {}),
                    **({RETRIES_FIELD: retries} if retries else {}))
