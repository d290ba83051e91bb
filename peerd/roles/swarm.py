"""The SWARM role: serve one pipeline stage of the run's model; a stage-0 server also trains as a trainer.

SWARM parallelism (Ryabinin et al. 2023, arXiv 2301.11913). A joining peer reads the stage announcements, serves
the swarm's bottleneck stage (:func:`protocols.swarm.choose_stage`; an empty stage first) or the stage it is given,
builds that stage of the model (:func:`peerd.models.build_stage`), serves it (:class:`StageService`, handlers
under ``ns.scoped(stage=k).prefix("swarm")``) and announces itself every ``status_interval_s`` under
``ns.scoped(stage=k).dht_key("servers")`` (stage, measured throughput, load). A trainer refreshes the servers of
every stage from those announcements and pushes micro-batches of the run's data through them
(:class:`PipelineTrainer`: stochastic wiring, retries on replicas, counts).

Every ``rebalance_period_s`` (with jitter) a server checks Petals' rule (:func:`protocols.swarm.should_move`) on
the announcements and, if told to and no other server of the run is moving (a move claim in the DHT,
:mod:`peerd.roles.swarm_moves`), moves to the bottleneck stage, starting from the parameters of a live server there
(``state`` method of the stage service).

Stage rounds: the replicas of a stage average their parameters, as in SWARM (Ryabinin et al. 2023, section 3.2 and
appendix: the peers serving one stage synchronize with all-reduce, a plain average; Petals' servers of a block serve
identical weights). The servers of stage k hold the stage's parameters as one fragment (``stage<k>``, group keys
under ``ns.scoped(fragment="stage<k>")``) and, every ``[swarm] sync_interval_s`` (at wall-clock multiples of it, so
replicas meet), run a round on it with the run's outer-sync strategy
(:func:`peerd.roles.outer_sync.make_outer_sync`) whose outer step is fixed to plain averaging
(:func:`protocols.swarm.stage_round_hyperparams`: lr 1, no momentum): after a round every replica holds ``sum_i w_i
theta_i / sum_i w_i`` (w_i: the samples replica i trained on since its last round; a replica that trained on none
only receives), plus the local steps it took while the round ran. Each replica keeps its own AdamW moments across
the replacement: the average lies among the replicas' own parameters (a displacement no larger than theirs since the
last round), so the moments, estimated on the same data, still fit it. ``[diloco]`` outer_lr / outer_momentum /
outer_nesterov are therefore not used (a SWARM run config that sets outer_lr or outer_momentum to anything but 1 and
0 is refused: a DiLoCo outer step on wall-clock rounds of replicas that step every micro-batch made the loss stall
or climb back after a few hundred micro-batches; see :func:`protocols.swarm.stage_round_hyperparams`). A server
whose stage-mates are rounds ahead, or that a round's leader refuses, adopts a live mate's state (``outer`` method
of the stage service); a mover adopts it with the parameters.

With ``[swarm] skip_ratio > 0`` (SkipPipe, Blagoev et al. 2025, arXiv 2502.19913) a trainer sends each micro-batch
along the path and to the servers :class:`protocols.skippipe.SkipPlanner` plans from its wiring; a middle stage
without a server is skipped instead of stopping training.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Optional

import torch

from peerd.config import ConfigError
from peerd.events import StageMoved, StageRoundDone, SwarmProgress
from peerd.models import build_stage
from peerd.runtime.heap import freeze_heap
from peerd.runtime.processes import reap
from peerd.roles.batch_sources import open_batch_source
from peerd.roles.base import RunContext
from peerd.roles.fragments import FragmentState, fragment
from peerd.roles.outer_sync import OuterSync, RoundFailure, RoundOutcome, RoundResult, make_outer_sync
from peerd.roles.outer_sync import Refused as RoundRefused
from peerd.roles.swarm_moves import MoveClaims
from protocols.diloco import OuterState
from protocols.rpc import RpcError
from protocols.skippipe import NoPath, SkipPlanner
from protocols.stage_service import (
    PipelineTrainer, StageService, download_outer_state, download_stage_parameters, load_flat_parameters,
)
from protocols.swarm import (
    StageAnnouncement, Wiring, choose_stage, rebalance_delay_s, should_move, stage_round_hyperparams,
)

__all__ = ["SwarmRole", "read_stage_servers", "stage_key", "stage_service_name"]

logger = logging.getLogger(__name__)

ROLE = "swarm"

#: How often a trainer re-reads the stage announcements, in seconds.
REFRESH_S = 2.0


def stage_service_name(ctx: RunContext, stage: int) -> str:
    """Handler prefix of stage ``stage``'s servers."""
    return ctx.namespace.scoped(stage=stage).prefix(ROLE)


def stage_key(ctx: RunContext, stage: int) -> str:
    """DHT key of stage ``stage``'s announcements (subkey = each server's PeerID)."""
    return ctx.namespace.scoped(stage=stage).dht_key("servers")


async def read_stage_servers(ctx: RunContext) -> dict[str, StageAnnouncement]:
    """PeerID -> announcement of every live stage server of the run (malformed records and banned peers skipped;
    a peer announcing under a stage key other than its own stage is skipped too)."""
    num_stages = ctx.run.swarm.stages
    found: dict[str, StageAnnouncement] = {}
    for k in range(num_stages):
        with contextlib.suppress(ConnectionError):  # an unreachable DHT this time: the next refresh may succeed
            for peer, record in (await ctx.transport.discovery.get(stage_key(ctx, k))).items():
                announcement = StageAnnouncement.parse(record.value, num_stages)
                if announcement is None or announcement.stage != k or ctx.bans.is_banned(peer):
                    continue
                if peer not in found or announcement.seq > found[peer].seq:  # a mover's old record may linger
                    found[peer] = announcement
    return found


class SwarmRole:
    """Serve a stage; train if this peer is a trainer.

    Args:
        ctx: the run context (``ctx.run.parallelism == "swarm"``; ``ctx.run.swarm`` holds S and the wire settings).
        stage: the stage to serve (None: ``ctx.node.stage``, else the swarm's bottleneck when joining).
        trainer: push micro-batches through the swarm (None: ``ctx.node.swarm_role``; ``auto``: if this peer serves
            stage 0).
        max_steps: a trainer leaves after this many micro-batches (0: until stopped).
    """

    name = ROLE

    def __init__(self, ctx: RunContext, stage: Optional[int] = None, trainer: Optional[bool] = None,
                 max_steps: int = 0) -> None:
        num_stages = ctx.run.swarm.stages
        node_role = getattr(ctx.node, "swarm_role", "auto")
        if stage is None:
            stage = getattr(ctx.node, "stage", None)
        if trainer is None and node_role != "auto":
            trainer = node_role == "trainer"
        if stage is not None and ctx.run.stage_error(stage):
            raise ConfigError(ctx.run.stage_error(stage))
        self.ctx = ctx
        self.stage = stage
        self.trainer_wanted = trainer
        self.max_steps = max_steps
        self.service: Optional[StageService] = None
        self.sync_state: Optional[FragmentState] = None
        self.outer_sync: Optional[OuterSync] = None
        self.rounds: list[RoundOutcome] = []
        self._samples_at_round = 0
        self._stage_lock = asyncio.Lock()  # a move and a stage round never interleave
        self.wiring = Wiring(num_stages, ema_alpha=ctx.run.swarm.ema_alpha, ban_s=ctx.run.swarm.ban_s)
        self.losses: list[float] = []
        self.paths: list[tuple[int, ...]] = []  # SkipPipe: the path of every micro-batch sent
        self.moves: list[tuple[int, int]] = []
        self.move_claims = MoveClaims(ctx)
        self._missing_logged: tuple[int, ...] = ()  # the stages without a server the last wait line named
        self._seq = 0
        self._rng = random.Random(ctx.peer_id)
        if ctx.node.threads:
            torch.set_num_threads(ctx.node.threads)

    # --- serving ----------------------------------------------------------------------------------------------

    async def _join_stage(self) -> int:
        if self.stage is not None:
            return self.stage
        view = await read_stage_servers(self.ctx)
        assignment = {peer: a.stage for peer, a in view.items() if peer != self.ctx.peer_id}
        # an unmeasured server counts as one unit of throughput, so counts of servers decide until measured
        throughput = {peer: a.throughput or 1.0 for peer, a in view.items()}
        return choose_stage(assignment, throughput, self.ctx.run.swarm.stages)

    def _build_service(self, stage: int) -> tuple[StageService, FragmentState, OuterSync]:
        """The stage's service, its fragment's outer state (round 0 from the run's initial weights) and sync."""
        run, hp = self.ctx.run, self.ctx.run.diloco
        module = build_stage(run.model, run.seq_len, run.seed, stage, run.swarm.stages, device=self.ctx.device,
                             vocab_size=self.ctx.tokenizer.vocab_size)
        optimizer = torch.optim.AdamW(module.parameters(), lr=hp.inner_lr, betas=hp.inner_betas,
                                      weight_decay=hp.inner_weight_decay)
        frag = fragment(module, f"stage{stage}", tuple(n for n, _ in module.named_parameters()),
                        self.ctx.namespace, ROLE)
        state = FragmentState(frag, OuterState.initial(frag.flatten(module)), gossip_weight=1.0)

        def outer_state() -> tuple[torch.Tensor, torch.Tensor, int]:
            return state.outer.theta, state.outer.momentum, state.outer.outer_round

        # compute in the service's worker thread: a long forward does not hold up this peer's RPC and DHT traffic
        service = StageService(stage_service_name(self.ctx, stage), module, run.swarm, optimizer=optimizer,
                               bans=self.ctx.bans, device=self.ctx.device, outer_state=outer_state,
                               compute_thread=True)
        return service, state, make_outer_sync(self.ctx, state, stage_round_hyperparams(hp))

    async def announce(self) -> None:
        """Store this server's announcement now (a failed store is retried at the next period)."""
        assert self.service is not None and self.stage is not None
        # wall-clock milliseconds: newer than any record of this PeerID, a restarted process's included
        seq = max(self._seq + 1, int(time.time() * 1000))
        self._seq = seq
        outer_round = self.sync_state.outer.outer_round if self.sync_state is not None else 0
        value = StageAnnouncement(self.stage, self.service.throughput, self.service.pending, seq,
                                  outer_round).to_dict()
        discovery = self.ctx.transport.discovery
        with contextlib.suppress(ConnectionError):  # the DHT unreachable now: the next announcement comes soon
            await discovery.store(stage_key(self.ctx, self.stage), self.ctx.peer_id, value,
                                  discovery.time() + self.ctx.node.status_ttl_s)

    def _status_fields(self) -> dict:
        service, state = self.service, self.sync_state
        throughput = service.throughput if service is not None else None
        return dict(role="paused" if self.ctx.gate.paused else ROLE,
                    outer_round=state.outer.outer_round if state is not None else None,
                    inner_step=service.steps if service is not None else None,
                    loss=self.losses[-1] if self.losses else None,
                    tokens_per_s=throughput * self.ctx.run.seq_len if throughput else None,
                    digest=state.outer.digest()[:16] if state is not None else None, stage=self.stage)

    async def _announce_loop(self) -> None:
        while not self.ctx.stop.is_set():
            await self.announce()
            with contextlib.suppress(ConnectionError):  # reading first lets the board see a duplicate identity
                await self.ctx.status.records()
            await self.ctx.status.publish()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), self.ctx.node.status_interval_s)

    # --- rebalancing ------------------------------------------------------------------------------------------

    async def rebalance_once(self) -> Optional[int]:
        """Check Petals' rule on the current announcements; move if it says so and no other server is moving (a move
        claim in the DHT, :mod:`peerd.roles.swarm_moves`). Returns the new stage or None."""
        view = await read_stage_servers(self.ctx)
        view[self.ctx.peer_id] = StageAnnouncement(self.stage, self.service.throughput)
        assignment = {peer: a.stage for peer, a in view.items()}
        throughput = {peer: a.throughput or 1.0 for peer, a in view.items()}
        target = should_move(self.ctx.peer_id, assignment, throughput, self.ctx.run.swarm.stages,
                             self.ctx.run.swarm.balance_quality)
        if target is None:
            return None
        claim = await self.move_claims.claim(self.stage, target, view)
        if claim is None:  # another server is moving: the next check decides on what it then sees
            return None
        sources = [peer for peer, a in view.items() if a.stage == target and peer != self.ctx.peer_id]
        try:
            async with self._stage_lock:
                return target if await self._move(target, sources) else None
        finally:
            await self.move_claims.withdraw(claim)

    async def _still_wanted(self, target: int) -> bool:
        """Re-check the rule on a fresh view: another server may have moved while this one downloaded."""
        view = await read_stage_servers(self.ctx)
        view[self.ctx.peer_id] = StageAnnouncement(self.stage, self.service.throughput)
        return should_move(self.ctx.peer_id, {p: a.stage for p, a in view.items()},
                           {p: a.throughput or 1.0 for p, a in view.items()}, self.ctx.run.swarm.stages,
                           self.ctx.run.swarm.balance_quality) == target

    async def _move(self, target: int, sources: list[str]) -> bool:
        """Serve ``target`` instead, starting from the parameters of a live server there (or from the run's
        initial weights if the stage is empty). False (and nothing changed) if no source answered."""
        service, state, sync = self._build_service(target)
        source = ""
        if sources:
            numel = sum(p.numel() for p in service.stage.parameters())
            for peer in sources:
                name = stage_service_name(self.ctx, target)
                try:
                    flat = await download_stage_parameters(self.ctx.transport.streams, peer, name, numel,
                                                           self.ctx.run.swarm.call_timeout_s)
                except RpcError as e:
                    logger.info("stage %d parameters from %s failed: %s", target, peer, e)
                    continue
                load_flat_parameters(service.stage, flat.to(self.ctx.device))
                try:  # its outer state too: the mover's first stage round then shares its mates' theta_outer
                    theta, momentum, outer_round = await download_outer_state(
                        self.ctx.transport.streams, peer, name, numel, self.ctx.run.swarm.call_timeout_s)
                    state.outer = OuterState(theta, momentum, outer_round)
                    state.round_start_theta = theta
                except RpcError as e:  # its first round's leader refuses it, and it adopts the leader's state then
                    logger.info("stage %d outer state from %s failed: %s", target, peer, e)
                source = peer
                break
            else:
                return False
        view = await read_stage_servers(self.ctx)
        if not await self._still_wanted(target):
            return False

        def stage_throughput(k: int) -> Optional[float]:
            measured = [a.throughput for p, a in view.items() if a.stage == k and a.throughput]
            return sum(measured) if measured else None
        old, old_service, old_sync = self.stage, self.service, self.outer_sync
        self.stage, self.service, self.sync_state, self.outer_sync = target, service, state, sync
        self._samples_at_round = 0  # what it trained on its old stage is no weight in the new stage's rounds
        await sync.start()
        await service.start(self.ctx.transport)
        await self.announce()
        await old_service.stop()  # trainers that call the old stage here now are refused and retry on a replica
        await old_sync.stop()
        self.moves.append((old, target))
        self.ctx.events.publish(StageMoved(old, target, source, state.outer.outer_round, stage_throughput(old),
                                           stage_throughput(target)))
        return True

    async def _rebalance_loop(self) -> None:
        period = self.ctx.run.swarm.rebalance_period_s
        while not self.ctx.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), rebalance_delay_s(period, self._rng))
            if not self.ctx.stop.is_set():
                await self.rebalance_once()

    # --- stage rounds -----------------------------------------------------------------------------------------

    async def _adopt_outer(self, peer: str, keep_local: bool = False) -> bool:
        """Take ``peer``'s outer state of our stage; theta_local := its theta_outer unless ``keep_local``."""
        state, module = self.sync_state, self.service.stage
        try:
            theta, momentum, outer_round = await download_outer_state(
                self.ctx.transport.streams, peer, stage_service_name(self.ctx, self.stage),
                state.fragment.numel(module), self.ctx.run.swarm.call_timeout_s)
        except RpcError as e:
            logger.info("stage %d outer state from %s failed: %s", self.stage, peer, e)
            return False
        outer = OuterState(theta, momentum, outer_round)
        if keep_local:
            state.outer, state.round_start_theta = outer, theta
        else:
            await self.service.exclusive(lambda: state.reset_to_outer(module, outer))
        self._samples_at_round = self.service.samples
        logger.info("stage %d: adopted the outer state of %s (round %d)", self.stage, peer, outer_round)
        return True

    async def sync_once(self) -> RoundOutcome:
        """One outer round of this stage's replicas on the stage's parameters (see the module docstring).

        Returns the strategy's outcome (:class:`RoundResult`: theta_local := the new theta_outer plus the local
        steps taken while the round ran; :class:`RoundFailure`: nothing changed; :class:`Refused`: the leader's
        state was adopted; None: stopped)."""
        async with self._stage_lock:
            state, service, me = self.sync_state, self.service, self.ctx.peer_id
            mates = {p: a for p, a in (await read_stage_servers(self.ctx)).items()
                     if a.stage == self.stage and p != me}
            ahead = sorted((a.outer_round, p) for p, a in mates.items() if a.outer_round > state.outer.outer_round)
            if ahead:  # we missed rounds (a restart, a lost round): start from where the stage is
                await self._adopt_outer(ahead[-1][1])
            live = {p: {"outer_round": a.outer_round} for p, a in mates.items()}
            live[me] = {"outer_round": state.outer.outer_round}
            local = await service.exclusive(lambda: state.fragment.flatten(service.stage))  # (P,)
            weight = float(service.samples - self._samples_at_round)
            samples = service.samples
            # mates behind adopt our state first and then join this round: wait for them too
            behind = frozenset(p for p, a in mates.items() if a.outer_round < state.outer.outer_round)
            outcome = await self.outer_sync.round(local, weight, live, behind)
            if isinstance(outcome, RoundResult):
                # steps taken while the round ran are kept on top of the new theta_outer (zero if none: then the
                # replicas hold bit-identical parameters)
                def keep_local_steps() -> None:
                    since = state.fragment.flatten(service.stage) - local
                    state.fragment.load_(service.stage, state.outer.theta + since)

                await service.exclusive(keep_local_steps)
                state.round_start_theta = state.outer.theta
                self._samples_at_round = samples
                self.ctx.events.publish(StageRoundDone(
                    self.stage, state.outer.outer_round, outcome.group_size, outcome.bytes_sent,
                    outcome.bytes_received, weight, state.outer.digest()[:16]))
            elif isinstance(outcome, RoundRefused):
                await self._adopt_outer(outcome.leader)
            elif isinstance(outcome, RoundFailure):
                logger.warning("stage %d: outer round %d failed: %s", self.stage, state.outer.outer_round + 1,
                               outcome.reason)
            self.rounds.append(outcome)
        await self.announce()
        return outcome

    async def _sync_loop(self) -> None:
        interval = self.ctx.run.swarm.sync_interval_s
        while interval and not self.ctx.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), interval - time.time() % interval)
            if self.ctx.stop.is_set():
                break
            try:
                await self.sync_once()
            except Exception:  # boundary: one bad round must not end serving: the next one may succeed
                logger.exception("stage %d: outer round failed", self.stage)

    # --- training ---------------------------------------------------------------------------------------------

    async def _refresh(self) -> bool:
        """Update the wiring from the announcements; True if every stage has a server (with SkipPipe, the first
        and the last: middle stages without one are skipped)."""
        by_stage: dict[int, list[str]] = {k: [] for k in range(self.ctx.run.swarm.stages)}
        for peer, announcement in (await read_stage_servers(self.ctx)).items():
            by_stage[announcement.stage].append(peer)
        # this peer's own stage is in the wiring too: the trainer calls it in-process (PipelineTrainer.local_stage)
        self.wiring.set_servers(by_stage)
        if self.ctx.run.swarm.skip_ratio > 0:
            needed = (0, self.ctx.run.swarm.stages - 1)
        else:
            needed = tuple(by_stage)
        missing = tuple(k for k in needed if not by_stage[k])
        others = tuple(k for k in missing if k != self.stage)  # our own announcement is a moment away
        if others and others != self._missing_logged:  # once per wait, not once per look
            logger.info("waiting for a server of stage %s (none announced yet): training starts when every stage "
                        "has one", ", ".join(map(str, others)), extra={"event": "swarm_waiting",
                                                                       "stages": list(others)})
        self._missing_logged = others
        return not missing

    async def _train(self) -> None:
        sampler = open_batch_source(self.ctx)  # the run's batches (peerd.data.sources); no resume: none is kept
        try:
            if await sampler.start():
                await self._train_from(sampler)
        finally:
            await sampler.close()

    async def _train_from(self, sampler) -> None:
        run, node = self.ctx.run, self.ctx.node
        trainer = PipelineTrainer(self.ctx.transport.streams, lambda k: stage_service_name(self.ctx, k),
                                  self.wiring, run.swarm, d_model=self.service.stage.config.d_model,
                                  local_stage=lambda k: self.service if self.stage == k else None,
                                  rng=random.Random(f"{self.ctx.peer_id}/spot-check"))
        planner = (SkipPlanner(run.swarm.stages, run.swarm.skip_ratio, seed=self.ctx.peer_id)
                   if run.swarm.skip_ratio > 0 else None)
        refreshed = logged = float("-inf")
        while not self.ctx.stop.is_set() and (not self.max_steps or len(self.losses) < self.max_steps):
            if time.monotonic() - refreshed >= REFRESH_S:
                if not await self._refresh():
                    # a micro-batch sent now would be dropped: wait for every stage to have a server
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.ctx.stop.wait(), 0.5)
                    continue
                refreshed = time.monotonic()
            if self.ctx.gate.paused:
                await self._wait_running()
                continue
            path, prefer = None, None
            if planner is not None:
                try:
                    path, prefer = planner.next(self.wiring)
                except NoPath:  # the first or the last stage's servers are all banned: wait for a new view
                    refreshed = float("-inf")
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.ctx.stop.wait(), 0.5)
                    continue
                self.paths.append(path)
            if not await sampler.ready():  # stopped while the next shard was not there yet
                break
            x, y = sampler.next_batch()
            loss = await trainer.step(x.long(), y.long(), path=path, prefer=prefer)
            if loss is not None:
                self.losses.append(loss)
            else:  # dropped (no live server of a stage): wait for the view to change instead of dropping more
                refreshed = float("-inf")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.ctx.stop.wait(), REFRESH_S)
            stats = self.wiring.stats
            if node.log_every_steps and stats.sent % node.log_every_steps == 0:
                # a line at info level at most every swarm_progress_interval_s; the ones between at debug level
                now = time.monotonic()
                quiet = now - logged < getattr(node, "swarm_progress_interval_s", 30.0)
                logged = logged if quiet else now
                self.ctx.events.publish(SwarmProgress(len(self.losses), loss, stats.sent, stats.completed,
                                                      stats.retried, stats.dropped, quiet=quiet))

    async def _wait_running(self) -> None:
        """Return once the pause is lifted or a stop is requested (the server keeps serving meanwhile)."""
        waits = {asyncio.ensure_future(self.ctx.gate.wait_running()), asyncio.ensure_future(self.ctx.stop.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    # --- the role ---------------------------------------------------------------------------------------------

    async def run(self, ctx: RunContext) -> None:
        """Serve (and train) until ``ctx.stop`` is set, or until ``max_steps`` micro-batches were trained."""
        self.stage = await self._join_stage()
        self.service, self.sync_state, self.outer_sync = self._build_service(self.stage)
        await self.outer_sync.start()
        await self.service.start(ctx.transport)
        logger.info("serving stage %d of %d as %s", self.stage, ctx.run.swarm.stages, ctx.peer_id)
        ctx.status.set_source(self._status_fields)
        announcer = asyncio.ensure_future(self._announce_loop())
        rebalancer = asyncio.ensure_future(self._rebalance_loop())
        syncer = asyncio.ensure_future(self._sync_loop())
        freeze_heap()  # the stage's model and every module exist now: later full collections skip them
        try:
            trains = self.trainer_wanted if self.trainer_wanted is not None else self.stage == 0
            if trains:
                await self._train()
            else:
                await ctx.stop.wait()
        finally:
            await reap(announcer, rebalancer, syncer)
            await self.service.stop()
            await self.outer_sync.stop()
            await ctx.status.publish(role="left")  # never raises: a failed store is the board's to drop
            stats = self.wiring.stats
            logger.info("leaving run %s: served stage %d%s", ctx.run_id, self.stage,
                        f"; trained {len(self.losses)} micro-batches (sent {stats.sent}, completed {stats.completed}, "
                        f"retried {stats.retried}, dropped {stats.dropped})" if stats.sent else "",
                        extra={"event": "swarm_leave", "stage": self.stage, "micro_batches": len(self.losses),
                               "sent": stats.sent, "completed": stats.completed, "retried": stats.retried,
                               "dropped": stats.dropped})
