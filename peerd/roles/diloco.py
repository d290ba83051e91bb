"""The data-parallel DiLoCo role (Douillard et al. 2023, Alg. 1): inner steps on local data, outer rounds with the
swarm through the run's outer-sync strategy (:mod:`peerd.roles.outer_sync`).

Life of a worker:

1. Resume from its local checkpoint if there is one, then *catch up*: if a live peer (seen through the status
   records in the DHT) is at a later outer round, download theta_outer and the outer momentum from it.
2. Loop: run inner AdamW steps until the round's quota (H, or what remains of the current round for a joiner);
   then sync each fragment (the whole model: one fragment) with the strategy; on success theta_local restarts from
   the new theta_outer; evaluate; checkpoint.
3. On stop: abandon matchmaking (or let a running all-reduce finish, bounded), checkpoint, leave.

When a round fails (no group in time, too few peers, a reducer died, the leader refused our state), theta_outer and
the outer momentum stay exactly as they were, and theta_local is *not* reset: the worker keeps training, and its
next pseudo-gradient covers every step since the last successful round (its weight counts all those samples). If the
others completed the round without us, the status records show a later round and the worker downloads that state
before its next attempt, dropping its unsynchronized local steps. A leader that sees a member with a different
theta_outer digest refuses it; the refused worker downloads the leader's state. So no two members of a group ever
disagree on theta_outer.

With ``[diloco] overlap = "delayed"`` (:class:`protocols.diloco.DelayedOuterStep`, Streaming DiLoCo's overlap) the
all-reduce of round r runs in the background while round r+1's inner steps go on from theta_local: at a round
boundary the worker sends its pseudo-gradient (theta_outer - theta_local) and keeps training; between two inner steps,
as soon as the all-reduce has finished, it applies the average to theta_outer and merges theta_local with it
(``overlap_mix``). Compute waits only when an all-reduce outlasts a whole round. Every peer applies the same averages
to the same state, so theta_outer stays bit-identical. A background round that fails leaves theta_outer unchanged and
theta_local unmerged, so the next pseudo-gradient covers its steps too (weighted by all their samples); a worker that
adopts another peer's state drops both its round in flight and that carry. The model evaluated is theta_outer. On
stop the round in flight is finished (bounded) and applied before the final checkpoint.

Recovery after a failed round (either mode): the peers are back in step at the next boundary. theta_outer and the
momentum did not move, so every peer tries the same outer round again, under a fresh group key
(:func:`peerd.roles.outer_sync.group_key`: ``round<r>.retry<n>``, n = the failed tries of round r, the largest count
among ours and the live peers' status records): the old key's discovery records and the seal its leader remembers
outlive the failure, and a peer reaching the old key before its former leader came back was answered "already
sealed" (or handed the failed group) and failed once more. A group is never sealed early below ``min_group_size``
(:class:`protocols.matchmaking.Matchmaker`), and the delayed overlap also expects the last group's members whose
status records lapsed: a leader that missed one record sealed every member's round into failure.
The members' views of the live peers are pooled in matchmaking (each sends the PeerIDs it expects), so a group
seals early only once it has every peer any member knows of. A peer that still reaches the rendezvous after its group
sealed without it (no member's view had its record) is told so by the sealer
(:class:`peerd.roles.outer_sync.LeftOut`) and, without the overlap, waits until some live worker has finished that
round and adopts its state (its steps carried with ``straggler = "carry"``), so it trains the next round with the
others; being left out counts no failed try (a fresh group key would gather the latecomers into a rival group). It
used to train a further round on the stale state (missing that round too), or, with the smallest PeerID, average
alone after a matchmaking window, forking theta_outer and staying that window behind in every later round.

With ``[diloco] fragments = F`` > 1 (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512) the model is F
strided fragments (:mod:`protocols.streaming`), each with its own outer state, outer round and group keys; fragment
p syncs after step (p + 1) H/F of each cycle of H steps, and only its theta_local restarts from its new theta_outer.
The worker's outer round is its last fragment's; status records, state snapshots and checkpoints carry every
fragment's round.

While it downloads, a worker's status says ``role = "syncing"``, and the all-reduce peers count it in their round's
expected group size: they wait for it in matchmaking (bounded by ``matchmaking_timeout_s``) instead of sealing the
round without it. Otherwise a peer whose download takes longer than a round would find the swarm a round further
every time it finished, and download again forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from peerd.checkpoint import Checkpoint, CheckpointError, load_optimizer_tensors, optimizer_tensors
from peerd.config import ConfigError
from peerd.data import WindowSampler
from peerd.events import (
    CheckpointResumed,
    Evaluated,
    InnerProgress,
    Left,
    Paused,
    Resumed,
    RoundDone,
    RoundFailed,
    StateDownloaded,
)
from peerd.heap import trim_heap
from peerd.inner_step import InnerStep, enable_tf32, micro_batch_count, resolve_precision
from peerd.models import build_model
from peerd.roles.base import RunContext, eval_units, held_out_loss
from peerd.roles.fragments import FragmentState, fragment, whole_model
from peerd.roles.outer_sync import RETRIES_FIELD, LeftOut, Refused, RoundFailure, RoundResult, make_outer_sync
from peerd.roles.state_sync import StateSync
from protocols.codecs import all_finite
from protocols.diloco import DelayedOuterStep, OuterState, inner_lr_at, make_inner_optimizer, set_lr
from protocols.state_transfer import StateSnapshot
from protocols.streaming import FragmentSchedule, strided_fragments
from protocols.wire import ProtocolViolation

logger = logging.getLogger(__name__)

ROLE = "diloco"
#: Status role of a worker downloading the swarm's state: it joins the round in progress right after.
SYNCING = "syncing"


@dataclass
class RoundStats:
    """Counters a worker reports (status records, events, the demo's summary)."""

    rounds_ok: int = 0
    rounds_failed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    tokens: int = 0
    last_loss: Optional[float] = None
    last_eval: Optional[float] = None
    tokens_per_s: Optional[float] = None


class DiLoCoRole:
    """One peer's DiLoCo training. ``run()`` returns when stopped or after ``max_outer_rounds``."""

    name = ROLE

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        run, node = ctx.run, ctx.node
        self.run_cfg = run
        self.hp = run.diloco
        self.peer_id = ctx.peer_id
        self.device = ctx.device
        self.stats = RoundStats()
        self._syncing = False
        if node.threads:
            torch.set_num_threads(node.threads)
        corpus = ctx.training_corpus()
        self.eval_tokens = corpus.eval
        self._units = eval_units(ctx.tokenizer, self.eval_tokens, run)  # what the eval fields of events are per
        self.sampler = WindowSampler(corpus.train, run.seq_len, run.batch_size, seed=self.peer_id)
        self.model = build_model(run.model, run.seq_len, run.seed, ctx.tokenizer.vocab_size).to(self.device)
        self._setup_inner_step(node)
        self.steps_since_sync = 0
        self.samples_since_sync = 0
        self.schedule = FragmentSchedule(self.hp.inner_steps, self.hp.fragments)
        self.round_quota = self.schedule.stride

        weight = float(run.batch_size * self.hp.inner_steps)
        self.parts = [FragmentState(f, OuterState.initial(f.flatten(self.model)), weight)
                      for f in self._fragments(ctx)]
        self.syncs = [make_outer_sync(ctx, part) for part in self.parts]
        # the last fragment syncs at the end of each cycle of H steps: its outer round is the worker's
        self.part, self.sync = self.parts[-1], self.syncs[-1]
        # per fragment: (samples, steps) counted by _train_until_quota at its last successful round
        self._samples_total, self._steps_total = 0, 0
        self._synced_at = [(0, 0)] * len(self.parts)
        self._cycle: Optional[dict] = None  # the current cycle's exchange totals (fragments > 1)
        self._next_fragment = 0  # the fragment whose round comes at the next boundary (fragments > 1)
        self._snapshot: Optional[StateSnapshot] = None
        self._snapshot_of: Optional[tuple] = None
        self.state_sync = StateSync(ctx.transport, ctx.namespace.prefix(ROLE), self._current_snapshot,
                                    run.averaging.state_transfer().download_timeout_s)
        self.components = (*self.syncs, self.state_sync)
        self._in_flight: Optional[asyncio.Task] = None  # delayed overlap: the background all-reduce
        self._carry: Optional[tuple[float, int]] = None  # a failed background round's (samples, steps)
        self._eval_task: Optional[asyncio.Task] = None  # background_eval: the evaluation running now
        self._eval_model: Optional[torch.nn.Module] = None  # background_eval: the copy it evaluates
        self._writer = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="peerd-checkpoint")
                        if node.background_checkpoint else None)  # one thread: writes land in order, never overlap
        ctx.status.set_source(self._status_fields)

    def _fragments(self, ctx: RunContext) -> list:
        """The whole model as one fragment (``fragments = 1``, today's group keys), or F strided fragments."""
        if self.hp.fragments == 1:
            return [whole_model(self.model, ctx.namespace, ROLE)]
        named = list(self.model.named_parameters())
        try:
            groups = strided_fragments([n for n, _ in named], [p.numel() for _, p in named], self.hp.fragments)
        except ValueError as e:
            raise ConfigError(f"[diloco] fragments: {e}", key="fragments", reason=str(e)) from None
        return [fragment(self.model, f"f{p}", names, ctx.namespace, ROLE) for p, names in enumerate(groups)]

    @property
    def outer(self) -> OuterState:
        return self.part.outer

    @outer.setter
    def outer(self, value: OuterState) -> None:
        self.part.outer = value

    # ------------------------------------------------------------------------------------------------------ lifecycle

    async def run(self, ctx: Optional[RunContext] = None) -> None:
        """Train until stopped or ``max_outer_rounds`` is reached; always checkpoints before returning."""
        for component in self.components:
            await component.start()
        self._resume()
        status_task = asyncio.ensure_future(self.ctx.status.run())
        try:
            await self._catch_up(await self._live_peers())
            if not self.ctx.stop.is_set():  # Ctrl-C while joining: leave now, not after a full evaluation
                await self._evaluate_and_publish()
            while not self.ctx.stop.is_set() and not self._finished():
                await self._wait_while_paused()
                await self._train_until_quota()
                if self.ctx.stop.is_set() or self._finished():  # the delayed overlap lands rounds between steps
                    break
                if self.ctx.gate.paused:
                    continue
                await self._outer_round()
                trim_heap()  # the round's freed buffers back to the OS: without it the worker's RSS kept growing
        finally:
            if self._in_flight is not None:
                with contextlib.suppress(Exception):
                    if await self._land_in_flight() == "applied":
                        self._restart_local()  # leaving: the model kept is theta_outer, the local steps are dropped
            status_task.cancel()
            with contextlib.suppress(BaseException):
                await status_task
            if self._eval_task is not None:
                with contextlib.suppress(Exception):
                    await self._eval_task
            self._save_checkpoint(final=True)
            if self._local_dp is not None:
                self._local_dp.close()
            await self.ctx.status.publish(role="left")
            for component in self.components:
                with contextlib.suppress(Exception):
                    await component.stop()
        self.ctx.events.publish(Left(self.outer.outer_round, self.stats.bytes_sent, self.stats.bytes_received,
                                     self.stats.rounds_failed, self.ctx.run_id))

    def _finished(self) -> bool:
        limit = self.run_cfg.max_outer_rounds
        return bool(limit) and self.outer.outer_round >= limit

    # ---------------------------------------------------------------------------------------------------- inner steps

    def _setup_inner_step(self, node) -> None:
        """How this machine computes the run's inner step: micro-batches, precision, compile, checkpointing."""
        try:
            micro_batch_count(self.run_cfg.batch_size, node.micro_batch_size)
        except ValueError as e:
            raise ConfigError(f"micro_batch_size: {e}", key="micro_batch_size", reason=str(e)) from None
        self.precision = resolve_precision(node.precision, self.device)
        enable_tf32(self.device)
        if node.activation_checkpointing:
            if hasattr(self.model, "activation_checkpointing"):
                self.model.activation_checkpointing = True
            else:  # a node preset may ask for it whatever the run's model: train without it
                logger.warning("activation_checkpointing: model %r does not support it; training without it",
                               self.run_cfg.model)
        self._local_dp = None
        if len(node.local_devices) > 1:  # several devices, one peer: the helpers compile their own replicas
            from peerd.local_dp import LocalDataParallel, LocalDevicesError, replica_spec

            try:
                self._local_dp = LocalDataParallel(self.model, node.local_devices,
                                                   replica_spec(self.run_cfg, node, self.ctx.tokenizer.vocab_size,
                                                                self.precision))
            except LocalDevicesError as e:
                raise ConfigError(str(e), key="local_devices", reason=str(e)) from None
            logger.info("training on %d local devices as one peer: %s", len(node.local_devices),
                        ", ".join(node.local_devices))
        # The compiled module shares the parameters; everything else (flatten, checkpoints) uses self.model.
        self._forward = torch.compile(self.model) if node.compile and self._local_dp is None else self.model
        self._warmup_steps = 1 if node.compile else 0  # the first call compiles: not counted in tokens/s
        self._new_optimizer()

    def _new_optimizer(self) -> None:
        """A fresh inner optimizer (and the step that drives it)."""
        self.optimizer = make_inner_optimizer(self.model.parameters(), self.hp, torch.device(self.device).type)
        if self._local_dp is not None:
            self.inner_step = self._local_dp.inner_step(self.optimizer, self.precision)
            return
        self.inner_step = InnerStep(self.model, self.optimizer, batch_size=self.run_cfg.batch_size,
                                    micro_batch_size=self.ctx.node.micro_batch_size, precision=self.precision,
                                    grad_clip_norm=self.hp.grad_clip_norm, forward=self._forward)

    def _inner_step(self) -> torch.Tensor:
        """One inner step on a fresh batch of the run's size; runs in a worker thread. Returns the loss
        (nats/byte) as a 0-d tensor on the device, so the host does not wait for the device every step."""
        global_step = self.outer.outer_round * self.hp.inner_steps + self.steps_since_sync
        set_lr(self.optimizer, inner_lr_at(global_step, self.hp))
        x, y = self.sampler.next_batch()  # (B, T), (B, T)
        if torch.device(self.device).type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()  # lets the copies below overlap with queued kernels
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return self.inner_step(x, y)

    async def _train_until_quota(self) -> None:
        loop = asyncio.get_running_loop()
        tokens_per_step = self.run_cfg.batch_size * self.run_cfg.seq_len
        window_start, window_steps = time.perf_counter(), 0
        while (self.steps_since_sync < self.round_quota and not self.ctx.stop.is_set()
               and not self.ctx.gate.paused):
            loss_on_device = await loop.run_in_executor(None, self._inner_step)
            self.steps_since_sync += 1
            self.samples_since_sync += self.run_cfg.batch_size
            self._steps_total += 1
            self._samples_total += self.run_cfg.batch_size
            self.stats.tokens += tokens_per_step
            if await self._land_if_finished():
                break
            if self._warmup_steps:
                self._warmup_steps -= 1
                float(loss_on_device)  # wait for the compilation step to finish before the clock restarts
                window_start = time.perf_counter()
                continue
            window_steps += 1
            # the process's first step is reported too: a volunteer sees training start without waiting a window
            if (window_steps == self.ctx.node.log_every_steps or self.steps_since_sync == self.round_quota
                    or self.stats.last_loss is None):
                loss = float(loss_on_device)  # the only host-device sync of the window
                self.stats.last_loss = loss
                elapsed = time.perf_counter() - window_start
                self.stats.tokens_per_s = window_steps * tokens_per_step / max(elapsed, 1e-9)
                self.ctx.events.publish(InnerProgress(self.outer.outer_round, self.steps_since_sync, loss,
                                                      self.stats.tokens_per_s, self.round_quota))
                window_start, window_steps = time.perf_counter(), 0

    def _restart_local(self, outers: Optional[list[OuterState]] = None) -> None:
        """theta_local := theta_outer for every fragment (adopting ``outers`` first if given, one per fragment); the
        next round (cycle) starts from zero steps."""
        for i, part in enumerate(self.parts):
            part.reset_to_outer(self.model, outers[i] if outers is not None else None)
        self.steps_since_sync, self.samples_since_sync = 0, 0
        self.round_quota = self.schedule.stride
        self._synced_at = [(self._samples_total, self._steps_total)] * len(self.parts)
        self._cycle = None
        self._next_fragment = 0

    # --------------------------------------------------------------------------------------------------- outer rounds

    async def _outer_round(self) -> None:
        """One outer round with the run's strategy; on success theta_local restarts from theta_outer."""
        if self.hp.overlap == "delayed":
            await self._delayed_round()
            return
        if len(self.parts) > 1:
            await self._fragment_round()
            return
        records = await self._peer_records()
        live = _workers(records)
        margin = self.sync.catch_up_margin
        if margin is not None:
            carry = self._straggler_carry()
            if await self._catch_up(live, margin, heal_fork=True):
                self._apply_straggler_carry(carry)
                return
        started = time.perf_counter()
        r = self.outer.outer_round
        local = self.part.fragment.flatten(self.model)  # (P,)
        if self._sat_out_diverged(r, local):
            return
        syncing = _syncing(records)
        weight = float(self.samples_since_sync)
        steps = self.steps_since_sync
        outcome = await self.sync.round(local, weight, live, syncing)
        if outcome is None:
            return
        if isinstance(outcome, Refused):
            logger.warning("round %d: %s; adopting the leader's state after its round", r + 1, outcome.reason)
            await self._wait_for_round(outcome.outer_round)
            await self._download_from([outcome.leader])
            return
        if isinstance(outcome, LeftOut) and await self._rejoin(r, outcome):
            return
        if isinstance(outcome, RoundFailure):
            self._round_failed(r, outcome.reason, f"theta_outer unchanged, keeping {steps} local steps")
            self.round_quota = steps + self.hp.inner_steps
            return
        assert isinstance(outcome, RoundResult)
        if outcome.failure is not None:
            self._round_failed(r, outcome.failure, "keeping our own outer step")
        self._restart_local()
        self.stats.rounds_ok += 1
        self.stats.bytes_sent += outcome.bytes_sent
        self.stats.bytes_received += outcome.bytes_received
        self._save_checkpoint()
        await self.ctx.status.publish()  # before the evaluation: peers count on us in the next round from now
        n = outcome.group_size
        dp_bytes = int(steps * 2 * (n - 1) / n * 4 * self.outer.numel)
        eval_loss = await self._round_eval()
        self.ctx.events.publish(RoundDone(
            self.outer.outer_round, n, outcome.bytes_sent, outcome.bytes_received, outcome.allreduce_s,
            outcome.excluded, outcome.attempts, round(time.perf_counter() - started, 3), weight, steps, dp_bytes,
            self.outer.digest(), self.sync.method, eval_loss, self.stats.tokens, **self._units,
        ))

    async def _rejoin(self, r: int, outcome: LeftOut) -> bool:
        """Round ``r + 1``'s group sealed before we joined it: wait for its leader to finish the round and adopt that
        state now (our local steps carried into the next round with ``straggler = "carry"``), so that we train the
        next round with the others. True if we adopted a state.

        Before, such a peer trained a whole further round on its stale state and the others, not counting a peer a
        round behind, sealed that round without it too; and one with the smallest PeerID averaged alone after an
        idle window, then reached every later boundary that window after the others and missed every later group."""
        carry, steps = self._straggler_carry(), self.steps_since_sync
        await self._wait_for_round(outcome.outer_round)
        if not await self._catch_up(await self._live_peers()):
            return False
        self._round_failed(r, outcome.reason, "adopted the state of the round that went on without us, "
                           + ("carrying" if carry is not None else "dropping") + f" our {steps} local steps")
        self._apply_straggler_carry(carry)
        return True

    def _straggler_carry(self) -> Optional[tuple[int, torch.Tensor, int]]:
        """With ``straggler = "carry"``: (our outer round, pseudo-gradient (P,) against our theta_outer, samples)
        before a possible catch-up; None otherwise (or with nothing worth carrying)."""
        if self.hp.straggler != "carry" or not self.samples_since_sync or self.sync.method != "allreduce":
            return None
        delta = self.outer.pseudo_gradient(self.part.fragment.flatten(self.model))  # (P,)
        return (self.outer.outer_round, delta, self.samples_since_sync) if all_finite(delta) else None

    def _apply_straggler_carry(self, carry: Optional[tuple[int, torch.Tensor, int]]) -> None:
        """After adopting the state of the swarm one round ahead: theta_local := theta_outer - delta, so the next
        pseudo-gradient holds our missed round's steps too, and its weight their samples."""
        if carry is None:
            return
        r, delta, samples = carry
        if self.outer.outer_round != r + 1:  # further ahead: too stale to add to the next round
            return
        self.part.fragment.load_(self.model, self.outer.theta - delta)
        self.samples_since_sync += samples
        logger.info("round %d went on without us: carrying our pseudo-gradient (%d samples) into round %d",
                    r + 1, samples, r + 2)

    def _sat_out_diverged(self, r: int, local: torch.Tensor) -> bool:
        """If theta_local ((P,)) is not finite, sit round ``r + 1`` out: nobody can use our contribution (and the
        all-reduce would refuse it); restart from theta_outer with a fresh inner optimizer. True if it did."""
        if all_finite(local):
            return False
        self._round_failed(r, "local pseudo-gradient is not finite (local training diverged)",
                           f"dropping {self.steps_since_sync} local steps and the inner optimizer state, "
                           "restarting from theta_outer")
        self._new_optimizer()
        self._restart_local()
        return True

    # ------------------------------------------------------------------------------- Streaming DiLoCo fragments

    async def _fragment_round(self) -> None:
        """The round of the fragment due at this step of the cycle (``fragments`` > 1; Douillard et al. 2025, arXiv
        2501.18512, sec. 2.2). Only that fragment's theta_local restarts from its new theta_outer; the others keep
        training. A failed fragment round is tried again H/F steps later, its local steps kept, before any other
        fragment: the peers' schedules realign on it, as a failed whole-model round is retried with more steps. The
        cycle's RoundDone (bytes summed over its fragment rounds) is published when its last fragment syncs."""
        j = self._next_fragment
        records = await self._peer_records()
        live = _workers(records)
        if await self._catch_up(live) or await self._catch_up_fragment(j, live):
            return
        part, sync = self.parts[j], self.syncs[j]
        r = part.outer.outer_round
        local = part.fragment.flatten(self.model)  # (P_j,)
        position = self.steps_since_sync
        if self._sat_out_diverged(r, local):
            self._seek(position, j)  # the schedule goes on with the others
            return
        if self._cycle is None:
            self._cycle = dict(started=time.perf_counter(), sent=0, received=0, seconds=0.0, excluded={}, attempts=1,
                               group=0, weight=0.0, steps=0)
        syncing = _syncing(records)
        samples_at, steps_at = self._synced_at[j]
        weight, steps = float(self._samples_total - samples_at), self._steps_total - steps_at
        outcome = await sync.round(local, weight, live, syncing)
        if outcome is None:
            return
        if isinstance(outcome, Refused):
            logger.warning("round %d of fragment %d: %s; adopting the leader's state", r + 1, j, outcome.reason)
            await self._wait_for_round(outcome.outer_round if j == len(self.parts) - 1 else r)
            await self._download_from([outcome.leader])
            return
        if isinstance(outcome, RoundFailure):
            self._round_failed(r, f"fragment {j}: {outcome.reason}",
                               f"its theta_outer unchanged, keeping its {steps} local steps, retrying it next")
            self._seek(position, j)
            return
        assert isinstance(outcome, RoundResult)
        part.reset_to_outer(self.model)
        self._synced_at[j] = (self._samples_total, self._steps_total)
        cycle = self._cycle
        cycle["sent"] += outcome.bytes_sent
        cycle["received"] += outcome.bytes_received
        cycle["seconds"] += outcome.allreduce_s
        cycle["excluded"].update(outcome.excluded)
        cycle["attempts"] = max(cycle["attempts"], outcome.attempts)
        cycle["group"] = max(cycle["group"], outcome.group_size)
        cycle["weight"], cycle["steps"] = weight, steps
        self.stats.bytes_sent += outcome.bytes_sent
        self.stats.bytes_received += outcome.bytes_received
        last = j == len(self.parts) - 1
        self._seek(0 if last else position, 0 if last else j + 1)
        await self.ctx.status.publish()
        if not last:
            return
        cycle, self._cycle = self._cycle, None
        self.stats.rounds_ok += 1
        self._save_checkpoint()
        n = cycle["group"]
        dp_bytes = int(self.hp.inner_steps * 2 * (n - 1) / n * 4 * sum(p.outer.numel for p in self.parts))
        eval_loss = await self._round_eval()
        self.ctx.events.publish(RoundDone(
            self.outer.outer_round, n, cycle["sent"], cycle["received"], round(cycle["seconds"], 3), cycle["excluded"],
            cycle["attempts"], round(time.perf_counter() - cycle["started"], 3), cycle["weight"], cycle["steps"],
            dp_bytes, self._digest(), self.sync.method, eval_loss, self.stats.tokens, **self._units,
        ))

    def _seek(self, step_in_cycle: int, next_fragment: int) -> None:
        """Continue the cycle after its step ``step_in_cycle``: ``next_fragment`` syncs after H/F more steps (or at
        the cycle's next boundary, where a download put us mid-stride)."""
        self.steps_since_sync = step_in_cycle
        self._next_fragment = next_fragment
        self.round_quota = self.schedule.next_boundary(step_in_cycle)

    def _fragment_rounds(self) -> list[int]:
        return [p.outer.outer_round for p in self.parts]

    async def _catch_up_fragment(self, j: int, live: dict[str, dict]) -> bool:
        """Download the state of a live peer whose fragment ``j`` is at a later round than ours: its round happened
        without us. True if we adopted a state."""
        mine = self.parts[j].outer.outer_round
        ahead = sorted(((s["fragment_rounds"][j], p) for p, s in live.items()
                        if p != self.peer_id and isinstance(s.get("fragment_rounds"), list)
                        and len(s["fragment_rounds"]) == len(self.parts) and s["fragment_rounds"][j] > mine),
                       reverse=True)
        return bool(ahead) and await self._download_from([p for _, p in ahead])

    def _digest(self) -> str:
        """theta_outer's digest: the whole model's (one fragment), else the SHA-256 of the fragments' digests."""
        if len(self.parts) == 1:
            return self.outer.digest()
        return hashlib.sha256("|".join(p.outer.digest() for p in self.parts).encode()).hexdigest()

    # ------------------------------------------------------------------------------------------ delayed outer rounds

    async def _delayed_round(self) -> None:
        """Round boundary with the delayed overlap: send this round's pseudo-gradient to a background all-reduce and
        train on from theta_local (:class:`protocols.diloco.DelayedOuterStep`)."""
        if self._in_flight is not None:  # the last exchange outlasted this round's inner steps: compute waits here
            if await self._land_in_flight() == "adopted" or self._finished():
                return
        r = self.outer.outer_round
        local = self.part.fragment.flatten(self.model)  # (P,)
        if self._sat_out_diverged(r, local):
            return
        delta = DelayedOuterStep(self.outer).boundary(local)  # every step since theta_outer last moved
        weight, steps = float(self.samples_since_sync), self.steps_since_sync
        if self._carry is not None:  # a failed round's samples: theta_outer did not move, delta already holds them
            carried_weight, carried_steps = self._carry
            weight, steps = weight + carried_weight, steps + carried_steps
            self._carry = None
        records = await self._peer_records()
        live = _workers(records)
        if await self._catch_up(live, self.sync.catch_up_margin or 1, heal_fork=True):
            return
        syncing = _syncing(records)
        # the last group's members without any status record now: on a loaded machine a record can lapse between two
        # publications, and a leader that did not count such a peer sealed the group without it. Waiting for one
        # that died costs an idle window of the background matchmaking, not compute
        lapsed = self.sync.last_members - records.keys() - {self.peer_id}
        self._in_flight = asyncio.ensure_future(
            self._background_exchange(delta, weight, steps, live, syncing | lapsed))
        self.steps_since_sync, self.samples_since_sync = 0, 0  # theta_local goes on: no restart
        self.round_quota = self.schedule.stride
        self._save_checkpoint()
        await self.ctx.status.publish()  # peers count on us in the next round from now

    async def _land_if_finished(self) -> bool:
        """Between two inner steps: land the background all-reduce if it has finished. True if training should stop
        (the last round of ``max_outer_rounds`` landed)."""
        if self._in_flight is None or not self._in_flight.done():
            return False
        await self._land_in_flight()
        return self._finished()

    async def _background_exchange(self, delta: torch.Tensor, weight: float, steps: int, live: dict,
                                   syncing: frozenset[str]):
        """All-reduce ``delta`` (P,) for the round after theta_outer; ``(outcome, delta, weight, steps, started)``.
        Peers still at the previous round (not at their boundary yet) are expected too."""
        started = time.perf_counter()
        r = self.outer.outer_round
        outcome = await self.sync.exchange(delta, weight, live, syncing, also_expect=(r - 1,))
        return outcome, delta, weight, steps, started

    async def _land_in_flight(self) -> str:
        """Wait for the background all-reduce and land it: "applied" (theta_outer took its outer step, theta_local
        merged with it, RoundDone published), "failed" (theta_outer unchanged, its samples carried into the next
        round's weight) or "adopted" (refused: we took the leader's state)."""
        task, self._in_flight = self._in_flight, None
        outcome, delta, weight, steps, started = await task
        r = self.outer.outer_round
        if isinstance(outcome, Refused):
            logger.warning("round %d: %s; adopting the leader's state after its round", r + 1, outcome.reason)
            await self._wait_for_round(outcome.outer_round)
            await self._download_from([outcome.leader])
            return "adopted"
        if not isinstance(outcome, tuple):  # a failure, or abandoned by a pause or stop
            reason = outcome.reason if isinstance(outcome, RoundFailure) else "abandoned (pause or stop)"
            self._round_failed(r, reason, f"theta_outer unchanged, carrying {steps} local steps into the next round")
            self._carry = (weight, steps)
            return "failed"
        result, attempts = outcome
        step = DelayedOuterStep(self.outer).complete(result.averaged, self.hp)
        self.outer = step.state
        if self._finished():  # the run's last outer step: the model is theta_outer
            self._restart_local()
        else:
            self.part.fragment.load_(self.model, step.merge(self.part.fragment.flatten(self.model), self.hp))
        self.stats.rounds_ok += 1
        self.stats.bytes_sent += result.bytes_sent
        self.stats.bytes_received += result.bytes_received
        n = result.group_size
        dp_bytes = int(steps * 2 * (n - 1) / n * 4 * self.outer.numel)
        fields = (self.outer.outer_round, n, result.bytes_sent, result.bytes_received, round(result.seconds, 3),
                  result.excluded, attempts, round(time.perf_counter() - started, 3), weight, steps, dp_bytes,
                  self.outer.digest(), self.sync.method)
        await self.ctx.status.publish()
        self.ctx.events.publish(RoundDone(*fields, await self._round_eval(), self.stats.tokens, **self._units))
        return "applied"

    def _drop_in_flight(self) -> None:
        """Another peer's state was adopted: the round in flight and any carry belong to the old state."""
        self._carry = None
        if self._in_flight is not None:
            self._in_flight.cancel()
            self._in_flight = None

    def _round_failed(self, r: int, reason: str, consequence: str) -> None:
        self.stats.rounds_failed += 1
        self.ctx.events.publish(RoundFailed(r, reason, self.sync.method, consequence))

    async def _wait_while_paused(self) -> None:
        """While the gate is paused: publish role "paused" (others stop counting on us), wait, then rejoin. Called
        only between rounds, so a pause never breaks a running all-reduce."""
        gate, stop = self.ctx.gate, self.ctx.stop
        if not gate.paused or stop.is_set():
            return
        self.ctx.events.publish(Paused(self.outer.outer_round, gate.reasons, self.steps_since_sync))
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
        self.ctx.events.publish(Resumed(self.outer.outer_round))
        await self.ctx.status.publish()
        await self._catch_up(await self._live_peers())  # before training: steps on a stale state would be dropped

    # ------------------------------------------------------------------------------------------------ catching up

    async def _peer_records(self) -> dict[str, dict]:
        """Status records of this run's peers, any role (PeerID -> record)."""
        return await self.ctx.status.records()

    async def _live_peers(self) -> dict[str, dict]:
        """Status records of live, training workers of this run (role ``diloco``; PeerID -> record)."""
        return _workers(await self._peer_records())

    async def _catch_up(self, live: dict[str, dict], margin: int = 1, heal_fork: bool = False) -> bool:
        """Download the state of the most advanced live peer if it is ``margin`` or more rounds ahead of us; with
        ``heal_fork``, else that of the live workers at our round whose theta_outer differs from ours and is held by
        more workers than ours (:meth:`_fork_majority`). True if we adopted a state."""
        mine = self.outer.outer_round
        ahead = sorted(
            ((s["outer_round"], p) for p, s in live.items() if p != self.peer_id and s["outer_round"] >= mine + margin),
            reverse=True,
        )
        sources = [p for _, p in ahead] or (self._fork_majority(live) if heal_fork else [])
        if not sources:
            return False
        adopted = await self._download_from(sources)
        if adopted:
            # join the round in progress: do only what the others still have to do
            now, tokens_per_step = time.time(), self.run_cfg.batch_size * self.run_cfg.seq_len
            in_round = [steps_done_now(s, now, tokens_per_step, self.hp.inner_steps, self.ctx.node.status_interval_s)
                        for s in live.values() if s["outer_round"] == self.outer.outer_round]
            if len(self.parts) == 1:
                self.round_quota = max(1, self.hp.inner_steps - max(in_round, default=0))
            else:  # into the cycle, before the next fragment boundary the adopted state has not synced
                self.steps_since_sync = min(max(max(in_round, default=0), self.steps_since_sync), self.round_quota - 1)
        return adopted

    def _fork_majority(self, live: dict[str, dict]) -> list[str]:
        """The live workers at our outer round that hold the theta_outer (status ``digest``) most workers at that
        round hold, ours counted, when it is not ours (ties: the larger digest, so that every worker picks the same);
        [] otherwise, and for methods whose members need not share theta_outer.

        Two groups of one round sealed apart (a latecomer's DHT reads missed the first group's records: 61 workers in
        one group, 2 in another) fork theta_outer under the same round numbers; their members never meet in one
        group again (the two reach each boundary at different times), so the fork lasted to the end of the run."""
        if not self.sync.same_theta or len(self.parts) > 1:
            return []
        own = self._digest()[:16]
        holders: dict[str, list[str]] = {}
        for peer, status in live.items():
            if peer != self.peer_id and status["outer_round"] == self.outer.outer_round and status.get("digest"):
                holders.setdefault(status["digest"], []).append(peer)
        counts = {digest: len(peers) for digest, peers in holders.items()}
        counts[own] = counts.get(own, 0) + 1
        best = max(counts, key=lambda digest: (counts[digest], digest))
        return [] if best == own else holders[best]

    async def _wait_for_round(self, outer_round: int) -> None:
        """Wait (bounded by the round's timeouts) until a live worker's status shows ``outer_round``: the group of
        the leader that refused us (or sealed without us) is finishing that round right now, and its state after the
        round is the one worth adopting. The leader's record missing from our view does not end the wait: on a loaded
        DHT records go missing for seconds, and a peer that stopped waiting then found nobody ahead, failed its round
        and trained the next one on the stale state (a third of 64 workers on one machine, in each of two rounds)."""
        loop = asyncio.get_running_loop()
        averaging = self.run_cfg.averaging
        deadline = loop.time() + averaging.matchmaking().max_wait + averaging.allreduce().reducer_timeout_s
        while loop.time() < deadline and not self.ctx.stop.is_set():
            if any(s["outer_round"] >= outer_round for p, s in (await self._live_peers()).items() if p != self.peer_id):
                return
            await asyncio.sleep(min(1.0, self.ctx.node.status_interval_s))

    async def _download_from(self, peers: list[str]) -> bool:
        """Adopt the outer state of the first of ``peers`` that serves a valid one; False if none did. Our status
        says SYNCING meanwhile, so that peers ahead wait for us in their round."""
        self._syncing = True
        await self.ctx.status.publish()
        try:
            return await self._download_first(peers)
        finally:
            self._syncing = False

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
        digest = outers[0].digest() if len(outers) == 1 else hashlib.sha256(
            "|".join(o.digest() for o in outers).encode()).hexdigest()
        if meta.get("digest") != digest:
            raise ProtocolViolation("state digest does not match its tensors")
        return outers

    async def _download_first(self, peers: list[str]) -> bool:
        got = await self.state_sync.download_first(peers, 2 * 4 * self._numel(), self._validate)
        if got is None:
            return False
        dropped = self.steps_since_sync
        self._drop_in_flight()
        self._restart_local(got.state)
        if len(self.parts) > 1:  # the fragments the adopted state synced this cycle tell where in the cycle it is
            synced = sum(1 for p in self.parts if p.outer.outer_round > self.outer.outer_round)
            self._seek(synced * self.schedule.stride, synced)
        self._syncing = False
        await self.ctx.status.publish()
        self.ctx.events.publish(StateDownloaded(self.outer.outer_round, got.peer, self._digest(), got.seconds,
                                                got.payload_bytes / 1e6, dropped))
        return True

    def _current_snapshot(self) -> StateSnapshot:
        """The outer state as served to joiners, rebuilt only when a fragment's state object changed."""
        outers = tuple(p.outer for p in self.parts)
        if self._snapshot is None or self._snapshot_of is None or any(
                a is not b for a, b in zip(outers, self._snapshot_of)):
            self._snapshot_of = outers
            metadata = {"outer_round": self.outer.outer_round, "digest": self._digest(),
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

    # ------------------------------------------------------------------------------------------ evaluation, status

    async def _evaluate(self) -> Optional[float]:
        """Held-out loss (nats/byte) of theta_local; None if the run's ``eval_batches`` is 0."""
        loss = await held_out_loss(self.model, self.eval_tokens, self.run_cfg)
        if loss is not None:
            self.stats.last_eval = loss
        return loss

    async def _round_eval(self) -> Optional[float]:
        """The evaluation after an outer round: every ``eval_every`` rounds and after the last one; in the background
        with the node's ``background_eval`` (then None here: an ``eval`` event follows)."""
        if self.outer.outer_round % self.run_cfg.eval_every and not self._finished():
            return None
        local_differs = len(self.parts) > 1 or self.hp.overlap == "delayed"  # theta_local is not theta_outer
        if not self.run_cfg.eval_batches or not (local_differs or self.ctx.node.background_eval):
            return await self._evaluate()
        if self._eval_task is not None:  # one at a time: the copy below is shared
            with contextlib.suppress(Exception):
                await self._eval_task
        if self._eval_model is None:
            self._eval_model = build_model(self.run_cfg.model, self.run_cfg.seq_len, self.run_cfg.seed,
                                           self.ctx.tokenizer.vocab_size).to(self.device)
        # With fragments, theta_local of the fragments synced earlier in the cycle has moved on, and with the delayed
        # overlap theta_local never restarts from theta_outer: the model evaluated is theta_outer (the same on every
        # peer), put together from the fragments. No inner step runs now: the parameters copied hold still.
        with torch.no_grad():
            for mine, theirs in zip(self._eval_model.parameters(), self.model.parameters()):
                mine.copy_(theirs)
        for part in self.parts:
            part.fragment.load_(self._eval_model, part.outer.theta)
        task = asyncio.ensure_future(self._evaluate_copy(self.outer.outer_round, self.stats.tokens))
        if not self.ctx.node.background_eval:
            return await task
        self._eval_task = task
        return None

    async def _evaluate_copy(self, outer_round: int, tokens: int) -> Optional[float]:
        """Held-out loss of the evaluation copy; in the background it is published as an ``eval`` event."""
        loss = await held_out_loss(self._eval_model, self.eval_tokens, self.run_cfg)
        if loss is not None:
            self.stats.last_eval = loss
        if self.ctx.node.background_eval:
            self.ctx.events.publish(Evaluated(outer_round, loss, tokens, **self._units))
        return loss

    async def _evaluate_and_publish(self) -> None:
        eval_loss = await self._evaluate()
        self.ctx.events.publish(Evaluated(self.outer.outer_round, eval_loss, self.stats.tokens, **self._units))

    def _status_fields(self) -> dict:
        role = "paused" if self.ctx.gate.paused else SYNCING if self._syncing else ROLE
        retries = {part.fragment.name: tries for part, sync in zip(self.parts, self.syncs)
                   if (tries := sync.retries()) is not None}
        return dict(role=role, outer_round=self.outer.outer_round, inner_step=self.steps_since_sync,
                    loss=self.stats.last_loss, tokens_per_s=self.stats.tokens_per_s,
                    eval_nats_per_byte=self.stats.last_eval, digest=self._digest()[:16],
                    tokens_trained=self.stats.tokens, rounds_contributed=self.stats.rounds_ok,
                    **({"fragment_rounds": self._fragment_rounds()} if len(self.parts) > 1 else {}),
                    **({RETRIES_FIELD: retries} if retries else {}))

    async def _publish_status(self, role: Optional[str] = None) -> None:
        await (self.ctx.status.publish(role=role) if role else self.ctx.status.publish())

    # ----------------------------------------------------------------------------------------------------- checkpoint

    def _save_checkpoint(self, final: bool = False) -> None:
        """Write the checkpoint; with the node's ``background_checkpoint`` a copy is written by the writer thread
        (``final``: and waited for, with every write before it)."""
        tensors = {"theta_outer": self._cat("theta"), "momentum": self._cat("momentum"),
                   "theta_local": torch.cat([p.fragment.flatten(self.model) for p in self.parts])}
        tensors.update(optimizer_tensors(self.optimizer))
        feedbacks = self._feedbacks()
        if feedbacks:  # what the sparse codec has not sent yet: lost on a restart otherwise
            tensors["error_feedback"] = torch.cat([f.error for f in feedbacks])
        metadata = {
            "run_id": self.ctx.run_id, "run_fingerprint": self.run_cfg.fingerprint(),
            "outer_round": self.outer.outer_round, "steps_since_sync": self.steps_since_sync,
            "samples_since_sync": self.samples_since_sync, "round_quota": self.round_quota,
            "sampler": self.sampler.state_dict(), "tokens": self.stats.tokens, "rounds_ok": self.stats.rounds_ok,
            "model": self.run_cfg.model, "seq_len": self.run_cfg.seq_len,  # what `peerd export` rebuilds
            "tokenizer": self.run_cfg.tokenizer,
        }
        if len(self.parts) > 1:  # each fragment's round, and the (samples, steps) it has not synced yet
            metadata["fragment_rounds"] = self._fragment_rounds()
            metadata["fragment_pending"] = [[self._samples_total - a, self._steps_total - b] for a, b in self._synced_at]
        if self._writer is None:
            self.ctx.checkpoints.save(Checkpoint(tensors, metadata))
            return
        # copies: theta_local, the optimizer's moments (views of live CPU tensors) change while the writer writes
        copied = {name: t.detach().clone() for name, t in tensors.items()}
        self._writer.submit(self.ctx.checkpoints.save, Checkpoint(copied, metadata))
        if final:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _feedbacks(self) -> list:
        """Each fragment's error feedback (a sparse codec's unsent remainder), or [] without a sparse codec."""
        feedbacks = [getattr(sync, "feedback", None) for sync in self.syncs]
        return [] if None in feedbacks else feedbacks

    def _resume(self) -> None:
        path = self.ctx.checkpoints.path
        checkpoint = self.ctx.checkpoints.load()
        if checkpoint is None:
            return
        meta = checkpoint.metadata
        if meta.get("run_fingerprint") != self.run_cfg.fingerprint():
            raise CheckpointError(
                f"checkpoint {path} was written under another configuration of run {self.ctx.run_id!r};"
                " move it away or use another --checkpoint-dir"
            )
        t = checkpoint.tensors
        try:
            rounds = meta["fragment_rounds"] if len(self.parts) > 1 else [int(meta["outer_round"])]
            for part, outer, local in zip(self.parts, self._outer_states(t["theta_outer"], t["momentum"], rounds),
                                          self._split(t["theta_local"])):
                part.outer = outer
                part.round_start_theta = outer.theta
                part.fragment.load_(self.model, local)
            feedbacks = self._feedbacks()
            if feedbacks and "error_feedback" in t:  # a checkpoint from before it was kept: the error restarts at 0
                for feedback, error in zip(feedbacks, self._split(t["error_feedback"])):
                    feedback.record(error.clone(), torch.zeros_like(error))
            if len(self.parts) > 1:
                self._samples_total, self._steps_total = 0, 0
                self._synced_at = [(-int(a), -int(b)) for a, b in meta["fragment_pending"]]
            load_optimizer_tensors(self.optimizer, t, self.device)
            self.sampler.load_state_dict(meta["sampler"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path} is incomplete or mismatched: {e}") from None
        self.steps_since_sync = int(meta["steps_since_sync"])
        self.samples_since_sync = int(meta["samples_since_sync"])
        self.round_quota = int(meta["round_quota"])
        self.stats.tokens = int(meta.get("tokens", 0))
        self.stats.rounds_ok = int(meta.get("rounds_ok", 0))  # the contribution counts on across restarts
        self.ctx.events.publish(CheckpointResumed(self.outer.outer_round, self._digest(), str(path),
                                                  self.steps_since_sync))


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


def _syncing(records: dict[str, dict]) -> frozenset[str]:
    """The peers whose status records say they are downloading the state (to join the round)."""
    return frozenset(peer for peer, value in records.items() if value.get("role") == SYNCING)


def _workers(records: dict[str, dict]) -> dict[str, dict]:
    """The records of training workers (role ``diloco`` with an outer round) among status records."""
    return {peer: value for peer, value in records.items()
            if value.get("role") == ROLE and isinstance(value.get("outer_round"), int)}
