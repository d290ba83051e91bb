"""The lifecycle every training role shares: set-up, the train/round loop, pause, evaluation, status, leaving.

:class:`WorkerCore` runs one training peer of a run (:meth:`WorkerCore.run`):

1. open: resume from the local checkpoint (:meth:`resume`), start the role's services (``components``), publish
   status records in the background;
2. join (:meth:`join`): catch up with the live peers, evaluate; then move the long-lived heap out of the garbage
   collector's way (:func:`peerd.runtime.heap.freeze_heap`);
3. loop until stopped or ``max_outer_rounds``: wait while the pause gate is closed (:meth:`wait_while_paused`),
   train to the next round boundary (:meth:`train_until_quota`), run one round (:meth:`run_round`);
4. leave: finish what is in flight, a last checkpoint, the status record ``role = "left"``, stop the services,
   publish :class:`peerd.events.Left`.

A role fills in the round-specific parts (the methods that raise NotImplementedError, and the hooks that do nothing
here); it never re-implements the loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import torch

from peerd.worker.checkpoint_file import Checkpoint, CheckpointError
from peerd.config import ConfigError
from peerd.events import Evaluated, Left, Paused, Resumed
from peerd.runtime.heap import freeze_heap, trim_heap
from peerd.runtime.processes import reap, stop_all
from peerd.worker.inner_step import enable_tf32, micro_batch_count, resolve_precision
from peerd.roles.base import RunContext, eval_units, held_out_loss
from peerd.roles.batch_sources import open_batch_source
from peerd.worker.stats import RoundStats

logger = logging.getLogger(__name__)

#: Status role of a paused worker: the others stop counting on it.
PAUSED = "paused"


class WorkerCore:
    """One training peer of a run. ``name``: the role's status role. Subclasses set ``model``, ``outer_round``,
    ``steps_since_sync`` and ``components`` (services started on open, stopped on leaving) in ``__init__``."""

    name: str = "worker"

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        run, node = ctx.run, ctx.node
        self.run_cfg = run
        self.hp = run.diloco
        self.peer_id = ctx.peer_id
        self.device = ctx.device
        self.stats = RoundStats()
        self.components: tuple = ()
        if node.threads:
            torch.set_num_threads(node.threads)
        # the run's batches and held-out tokens (peerd.data.sources); a shards:/hf: source has them once started
        self.sampler = open_batch_source(ctx)
        self._units_cache: Optional[dict] = None
        ctx.status.set_source(self.status_fields)

    @property
    def eval_tokens(self):
        """The run's held-out tokens, 1-D (N,) (None before a network source started)."""
        return self.sampler.eval_tokens

    @property
    def _units(self) -> dict:
        """What the eval fields of events are per (:func:`peerd.roles.base.eval_units`)."""
        if self._units_cache is None:
            self._units_cache = eval_units(self.ctx.tokenizer, self.eval_tokens, self.run_cfg)
        return self._units_cache

    def _check_inner_step(self) -> None:
        """How this machine computes the run's inner step (:mod:`peerd.worker.inner_step`): micro-batches and precision.
        Raises ConfigError naming ``micro_batch_size`` if it does not divide the batch."""
        try:
            micro_batch_count(self.run_cfg.batch_size, self.ctx.node.micro_batch_size)
        except ValueError as e:
            raise ConfigError(f"micro_batch_size: {e}", key="micro_batch_size", reason=str(e)) from None
        self.precision = resolve_precision(self.ctx.node.precision, self.device)
        enable_tf32(self.device)

    # ------------------------------------------------------------------------------------------------------ lifecycle

    async def run(self, ctx: Optional[RunContext] = None) -> None:
        """Train until stopped or ``max_outer_rounds`` is reached; always checkpoints before returning. Raises
        :class:`peerd.worker.checkpoint_file.CheckpointError` (before starting anything) if the local checkpoint does not fit."""
        self.resume()
        for component in self.components:
            await component.start()
        status_task = asyncio.ensure_future(self._status_loop())
        try:
            # the batch source first: a sharded run's data may come from peers (False: stopped meanwhile)
            started = await self.sampler.start()
            if started:
                await self.join()
                freeze_heap()  # the model, the state and every module exist now: later full collections skip them
            while started and not self.ctx.stop.is_set() and not self.finished():
                await self.wait_while_paused()
                await self.train_until_quota()
                if self.ctx.stop.is_set() or self.finished():  # a round may land between two inner steps
                    break
                if self.ctx.gate.paused:
                    continue
                await self.boundary_round()
                trim_heap()  # the round's freed buffers back to the OS: without it the worker's RSS kept growing
        finally:
            await self._finish_in_flight()
            await reap(status_task)
            await self._finish_background()
            self._save_final_checkpoint()
            await self.ctx.status.publish(role="left")
            await self._after_left()
            await stop_all(self.components)
            await self.sampler.close()
            await self._after_stop()
        self.ctx.events.publish(Left(self.outer_round, self.stats.bytes_sent, self.stats.bytes_received,
                                     self.stats.rounds_failed, self.ctx.run_id))

    def finished(self) -> bool:
        """True once ``max_outer_rounds`` (0: no limit) rounds are done."""
        limit = self.run_cfg.max_outer_rounds
        return bool(limit) and self.outer_round >= limit

    async def join(self) -> None:
        """Before the first round: catch up with the live peers, then evaluate (unless stopped meanwhile)."""
        raise NotImplementedError

    async def train_until_quota(self) -> None:
        """Inner steps until the next round boundary, a stop or a pause."""
        raise NotImplementedError

    async def run_round(self) -> None:
        """One round with the swarm at a boundary."""
        raise NotImplementedError

    async def boundary_round(self) -> None:
        """The round the training loop runs at a boundary: :meth:`run_round`, or less of it where a role lets the
        round finish publishing while training goes on."""
        await self.run_round()

    def resume(self) -> None:
        """Continue from the local checkpoint if there is one (:meth:`load_checkpoint`)."""
        raise NotImplementedError

    def digest(self) -> str:
        """SHA-256 (hex) of the state the peers agree on."""
        raise NotImplementedError

    def known_digest(self) -> Optional[str]:
        """:meth:`digest` where it costs nothing now (the status record's), else None: a worker whose digest is
        computed in a worker thread after a round says None until it is known."""
        return self.digest()

    async def _status_loop(self) -> None:
        """Publish this worker's status record every ``status_interval_s`` until cancelled."""
        await self.ctx.status.run()

    async def _finish_in_flight(self) -> None:
        """Leaving: land what runs in the background (a round in flight)."""

    async def _finish_background(self) -> None:
        """Leaving, after the status task stopped: wait for background work (an evaluation)."""

    def _save_final_checkpoint(self) -> None:
        """Leaving: the last checkpoint, and release what training held."""

    async def _after_left(self) -> None:
        """Leaving, right after the status record said so."""

    async def _after_stop(self) -> None:
        """Leaving, after the services stopped."""

    # ---------------------------------------------------------------------------------------------------------- pause

    async def wait_while_paused(self) -> None:
        """While the gate is paused: publish role "paused" (others stop counting on us), wait, then rejoin
        (:meth:`_on_resume`). Called only between rounds, so a pause never breaks a running all-reduce."""
        gate, stop = self.ctx.gate, self.ctx.stop
        if not gate.paused or stop.is_set():
            return
        self.ctx.events.publish(Paused(self.outer_round, gate.reasons, self.steps_since_sync))
        await self._on_pause()
        await self.ctx.status.publish()
        resumed = asyncio.ensure_future(gate.wait_running())
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({resumed, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            resumed.cancel()
            stopper.cancel()
        if stop.is_set():
            return
        self.ctx.events.publish(Resumed(self.outer_round))
        await self._on_resume()

    async def _on_pause(self) -> None:
        """The gate just closed (before the status record says so)."""

    async def _on_resume(self) -> None:
        """The gate reopened: rejoin the swarm before training (steps on a stale state would be dropped)."""
        await self.ctx.status.publish()

    # ----------------------------------------------------------------------------------------- evaluation, status

    async def evaluate(self) -> Optional[float]:
        """Held-out loss (nats/byte) of the model as it is now; None if the run's ``eval_batches`` is 0."""
        loss = await held_out_loss(self.model, self.eval_tokens, self.run_cfg)
        if loss is not None:
            self.stats.last_eval = loss
        return loss

    async def evaluate_and_publish(self) -> None:
        """:meth:`evaluate`, published as an :class:`peerd.events.Evaluated` event."""
        eval_loss = await self.evaluate()
        self.ctx.events.publish(Evaluated(self.outer_round, eval_loss, self.stats.tokens, **self._units))

    def status_role(self) -> str:
        """The ``role`` of this worker's status record now."""
        return PAUSED if self.ctx.gate.paused else self.name

    def status_fields(self) -> dict:
        """This worker's status record (:class:`peerd.roles.status_board.StatusBoard` adds time and version)."""
        return dict(role=self.status_role(), outer_round=self.outer_round, inner_step=self.steps_since_sync,
                    loss=self.stats.last_loss, tokens_per_s=self.stats.tokens_per_s,
                    eval_nats_per_byte=self.stats.last_eval, digest=_first16(self.known_digest()),
                    tokens_trained=self.stats.tokens, rounds_contributed=self.stats.rounds_ok)

    async def publish_status(self, role: Optional[str] = None) -> None:
        """Publish this worker's status record now (``role``: instead of its own, e.g. "left")."""
        await (self.ctx.status.publish(role=role) if role else self.ctx.status.publish())

    # ----------------------------------------------------------------------------------------------------- checkpoint

    def load_checkpoint(self) -> Optional[Checkpoint]:
        """The run's local checkpoint, or None if there is none. Raises CheckpointError if it was written under
        another configuration of the run (or by another role)."""
        checkpoint = self.ctx.checkpoints.load()
        if checkpoint is None:
            return None
        meta = checkpoint.metadata
        if meta.get("run_fingerprint") != self.run_cfg.fingerprint() or not self._checkpoint_is_mine(meta):
            raise CheckpointError(
                f"checkpoint {self.ctx.checkpoints.path} was written under another configuration of run "
                f"{self.ctx.run_id!r}; move it away or use another --checkpoint-dir"
            )
        return checkpoint

    def _checkpoint_is_mine(self, metadata: dict) -> bool:
        """Whether a checkpoint of this run's configuration was written by this role."""
        return True


def _first16(digest: Optional[str]) -> Optional[str]:
    return digest[:16] if digest is not None else None
