"""What every round strategy provides to the DiLoCo worker (:class:`peerd.worker.outer_worker.OuterWorker`)."""

from __future__ import annotations

import asyncio
import contextlib
from enum import Enum
from typing import Optional

from peerd.roles.fragments import Fragment, FragmentState, whole_model
from peerd.roles.outer_sync import make_outer_sync
from protocols.diloco import DelayedOuterStep, OuterState


class RoundEnd(str, Enum):
    """How a round at a boundary ended (:meth:`RoundStrategy.round`)."""

    DONE = "done"  #: the outer step was applied (with fragments: this fragment's)
    SENT = "sent"  #: the pseudo-gradient went to a background all-reduce (the delayed overlap); it lands later
    FAILED = "failed"  #: no outer step: theta_outer unchanged, the local steps kept for the next try
    ADOPTED = "adopted"  #: another peer's state was adopted instead (we were behind, forked or refused)
    SAT_OUT = "sat_out"  #: theta_local was not finite: the round was sat out, training restarted from theta_outer
    ABANDONED = "abandoned"  #: a stop or a pause came first


class RoundStrategy:
    """One way of syncing at round boundaries. ``parts``: one :class:`FragmentState` per fragment (the whole model:
    one); ``syncs``: their outer syncs. ``local_differs``: theta_local is not theta_outer after a round (so the
    round's evaluation puts theta_outer together in a copy). ``heals_forks``: a worker at our round holding another
    theta_outer (the whole model's digest) is a fork worth adopting (fragment rounds compare each fragment's round and
    digest instead, :meth:`FragmentRounds._catch_up_fragment`).

    The worker calls :meth:`round` at each boundary and the hooks below when its state changes under the rounds."""

    local_differs = False
    heals_forks = True

    def __init__(self, worker):
        self.worker = worker
        model, hp = worker.model, worker.hp
        weight = float(worker.run_cfg.batch_size * hp.inner_steps)
        self.parts = [FragmentState(f, OuterState.initial(f.flatten(model)), weight) for f in self.fragments()]
        self.syncs = [make_outer_sync(worker.ctx, part) for part in self.parts]

    def fragments(self) -> list[Fragment]:
        """The model's fragments: the whole model as one fragment, with the role's own group keys."""
        return [whole_model(self.worker.model, self.worker.ctx.namespace, self.worker.name)]

    async def round(self) -> RoundEnd:
        """One round at the boundary the worker reached: exchange, update theta_outer (or keep it on a failure),
        publish :class:`peerd.events.RoundDone` or :class:`peerd.events.RoundFailed`. Returns how it ended."""
        raise NotImplementedError

    async def between_steps(self) -> bool:
        """Called after every inner step. True if training should stop (the run's last round landed)."""
        return False

    def restarted(self) -> None:
        """theta_local just restarted from theta_outer for every fragment."""

    def adopted(self) -> None:
        """A downloaded state replaced ours (after :meth:`restarted`)."""

    def joined(self, steps_done: int) -> None:
        """After a download: the live peers at the adopted round have done ``steps_done`` of its inner steps; do only
        what they still have to do."""
        self.worker.round_quota = max(1, self.worker.hp.inner_steps - steps_done)

    def drop(self) -> None:
        """Another peer's state is being adopted: anything in flight belongs to the old state."""

    async def settled(self) -> None:
        """Wait until what the last :meth:`round` publishes after returning (its status record, its events) went
        out; at once for strategies that publish before returning."""

    async def publish_status(self) -> None:
        """Publish the worker's status record after a change peers count on (a new round, a fragment synced)."""
        await self.worker.ctx.status.publish()

    async def close(self) -> None:
        """Leaving: finish what is in flight (bounded)."""

    def checkpoint_metadata(self) -> dict:
        """What the strategy adds to the worker's checkpoint metadata."""
        return {}

    def resume(self, metadata: dict) -> None:
        """Read back :meth:`checkpoint_metadata` from a checkpoint. Raises KeyError/ValueError if it is incomplete."""


class LandsInFlight:
    """Mixin of the strategies that keep one exchange in flight (``in_flight``) while training goes on and apply it
    at a later boundary (:meth:`land`, returning a :class:`RoundEnd`): on leaving, the exchange still in flight is
    landed (bounded by the all-reduce's own timeouts), so its outer step is not lost.

    Their status records go out in the background (:meth:`publish_soon`): a record is a DHT store, 0.5-1.2 s on the
    WAN benchmark's loaded machine, which the inner steps waited for at every boundary and every landing."""

    _publishing: Optional[asyncio.Task] = None
    _publish_again = False

    def publish_soon(self) -> None:
        """Publish the worker's status record without holding up the inner steps: in a background task, one at a
        time (asked again while one runs, it publishes once more after it, so the last record stored is the
        newest)."""
        if self._publishing is not None and not self._publishing.done():
            self._publish_again = True
            return
        self._publishing = asyncio.ensure_future(self._publish())

    async def _publish(self) -> None:
        self._publish_again = True
        while self._publish_again:
            self._publish_again = False
            await self.worker.ctx.status.publish()  # a failed store is logged by the board, never raised

    async def publish_status(self) -> None:
        self.publish_soon()

    async def step_off_loop(self, outer: OuterState, outcome) -> Optional[tuple[OuterState, DelayedOuterStep]]:
        """For a finished exchange ``(result, attempts)`` against ``outer``: ``(outer, step)``, the outer step with
        its average and the new state's digest computed in a worker thread while the inner steps go on (on the event
        loop they held the next step up: two passes over P values and a SHA-256 of 8P bytes); None for any other
        outcome. Raises ValueError as :meth:`protocols.diloco.OuterState.apply`."""
        if not isinstance(outcome, tuple):
            return None

        def step() -> DelayedOuterStep:
            stepped = DelayedOuterStep(outer).complete(outcome[0].averaged, self.worker.hp)
            stepped.state.digest()  # kept by the state
            return stepped

        return outer, await asyncio.get_running_loop().run_in_executor(None, step)

    def landed_step(self, outer: OuterState, stepped: Optional[tuple[OuterState, DelayedOuterStep]],
                    averaged) -> DelayedOuterStep:
        """The outer step of ``outer`` with ``averaged``: the one :meth:`step_off_loop` computed if it started from
        ``outer`` (nothing replaced it meanwhile), else computed now."""
        if stepped is not None and stepped[0] is outer:
            return stepped[1]
        return DelayedOuterStep(outer).complete(averaged, self.worker.hp)

    async def close(self) -> None:
        if self.in_flight is not None:
            with contextlib.suppress(Exception):  # boundary: leaving; a failed last round must not stop the checkpoint
                if await self.land() == RoundEnd.DONE:
                    self.worker.restart_local()  # leaving: the model kept is theta_outer, the local steps dropped
        if self._publishing is not None:  # before the record that says we left: never after it
            with contextlib.suppress(Exception):  # boundary: leaving; a failed status publish must not stop it
                await self._publishing
