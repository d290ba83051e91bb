"""The SWARM role: serve one pipeline stage of the run's model; a stage-0 server also trains as a trainer.

SWARM parallelism (Ryabinin et al. 2023, arXiv 2301.11913). A joining peer reads the stage announcements, serves
the swarm's bottleneck stage (:func:`protocols.swarm.choose_stage`; an empty stage first) or the stage it is given,
builds that stage of the model (:func:`peerd.models.build_stage`), serves it (:class:`StageService`, handlers
under ``ns.scoped(stage=k).prefix("swarm")``) and announces itself every ``status_interval_s`` under
``ns.scoped(stage=k).dht_key("servers")`` (stage, measured throughput, load). A trainer refreshes the servers of
every stage from those announcements and pushes micro-batches of the run's data through them
(:class:`PipelineTrainer`: stochastic wiring, retries on replicas, counts).

Every ``rebalance_period_s`` (with jitter) a server checks Petals' rule (:func:`protocols.swarm.should_move`) on
the announcements and, if told to, moves to the bottleneck stage, starting from the parameters of a live server
there (``state`` method of the stage service).

Not yet here: stage replicas averaging their stage's parameters, status-record fields for stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Optional

import torch

from peerd.data import DataError, WindowSampler, load_corpus
from peerd.models import build_stage
from peerd.roles.base import RunContext
from protocols.rpc import RpcError
from protocols.stage_service import (
    PipelineTrainer, StageService, download_stage_parameters, load_flat_parameters,
)
from protocols.swarm import StageAnnouncement, Wiring, choose_stage, rebalance_delay_s, should_move

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
        with contextlib.suppress(Exception):  # an unreachable DHT this time: the next refresh may succeed
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
        stage: the stage to serve (None: the swarm's bottleneck when joining).
        trainer: push micro-batches through the swarm (None: if this peer serves stage 0).
        max_steps: a trainer leaves after this many micro-batches (0: until stopped).
    """

    name = ROLE

    def __init__(self, ctx: RunContext, stage: Optional[int] = None, trainer: Optional[bool] = None,
                 max_steps: int = 0) -> None:
        num_stages = ctx.run.swarm.stages
        if stage is not None and not 0 <= stage < num_stages:
            raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
        self.ctx = ctx
        self.stage = stage
        self.trainer_wanted = trainer
        self.max_steps = max_steps
        self.service: Optional[StageService] = None
        self.wiring = Wiring(num_stages, ema_alpha=ctx.run.swarm.ema_alpha, ban_s=ctx.run.swarm.ban_s)
        self.losses: list[float] = []
        self.moves: list[tuple[int, int]] = []
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

    def _build_service(self, stage: int) -> StageService:
        run, hp = self.ctx.run, self.ctx.run.diloco
        module = build_stage(run.model, run.seq_len, run.seed, stage, run.swarm.stages, device=self.ctx.device)
        optimizer = torch.optim.AdamW(module.parameters(), lr=hp.inner_lr, betas=hp.inner_betas,
                                      weight_decay=hp.inner_weight_decay)
        return StageService(stage_service_name(self.ctx, stage), module, run.swarm, optimizer=optimizer,
                            bans=self.ctx.bans, device=self.ctx.device)

    async def announce(self) -> None:
        """Store this server's announcement now (a failed store is retried at the next period)."""
        assert self.service is not None and self.stage is not None
        # wall-clock milliseconds: newer than any record of this PeerID, a restarted process's included
        seq = max(self._seq + 1, int(time.time() * 1000))
        self._seq = seq
        value = StageAnnouncement(self.stage, self.service.throughput, self.service.pending, seq).to_dict()
        discovery = self.ctx.transport.discovery
        with contextlib.suppress(Exception):
            await discovery.store(stage_key(self.ctx, self.stage), self.ctx.peer_id, value,
                                  discovery.time() + self.ctx.node.status_ttl_s)

    async def _announce_loop(self) -> None:
        while not self.ctx.stop.is_set():
            await self.announce()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), self.ctx.node.status_interval_s)

    # --- rebalancing ------------------------------------------------------------------------------------------

    async def rebalance_once(self) -> Optional[int]:
        """Check Petals' rule on the current announcements; move if it says so. Returns the new stage or None."""
        view = await read_stage_servers(self.ctx)
        view[self.ctx.peer_id] = StageAnnouncement(self.stage, self.service.throughput)
        assignment = {peer: a.stage for peer, a in view.items()}
        throughput = {peer: a.throughput or 1.0 for peer, a in view.items()}
        target = should_move(self.ctx.peer_id, assignment, throughput, self.ctx.run.swarm.stages,
                             self.ctx.run.swarm.balance_quality)
        if target is None:
            return None
        sources = [peer for peer, a in view.items() if a.stage == target and peer != self.ctx.peer_id]
        return target if await self._move(target, sources) else None

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
        service = self._build_service(target)
        if sources:
            numel = sum(p.numel() for p in service.stage.parameters())
            for peer in sources:
                try:
                    flat = await download_stage_parameters(
                        self.ctx.transport.streams, peer, stage_service_name(self.ctx, target), numel,
                        self.ctx.run.swarm.call_timeout_s)
                except RpcError as e:
                    logger.info("stage %d parameters from %s failed: %s", target, peer, e)
                    continue
                load_flat_parameters(service.stage, flat.to(self.ctx.device))
                break
            else:
                return False
        if not await self._still_wanted(target):
            return False
        old, old_service = self.stage, self.service
        self.stage, self.service = target, service
        await service.start(self.ctx.transport)
        await self.announce()
        await old_service.stop()  # trainers that call the old stage here now are refused and retry on a replica
        self.moves.append((old, target))
        logger.info("moved from stage %d to stage %d (the bottleneck)", old, target)
        return True

    async def _rebalance_loop(self) -> None:
        period = self.ctx.run.swarm.rebalance_period_s
        while not self.ctx.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), rebalance_delay_s(period, self._rng))
            if not self.ctx.stop.is_set():
                await self.rebalance_once()

    # --- training ---------------------------------------------------------------------------------------------

    async def _refresh(self) -> bool:
        """Update the wiring from the announcements; True if every stage has a server."""
        by_stage: dict[int, list[str]] = {k: [] for k in range(self.ctx.run.swarm.stages)}
        for peer, announcement in (await read_stage_servers(self.ctx)).items():
            by_stage[announcement.stage].append(peer)
        self.wiring.set_servers(by_stage)
        return all(by_stage.values())

    async def _train(self) -> None:
        run, node = self.ctx.run, self.ctx.node
        if run.dataset == "local" and not node.data:
            raise DataError(f"run {self.ctx.run_id!r} trains on local data: pass --data PATH|GLOB")
        corpus = load_corpus(node.data or "shakespeare")
        sampler = WindowSampler(corpus.train, run.seq_len, run.batch_size, seed=self.ctx.peer_id)
        trainer = PipelineTrainer(self.ctx.transport.streams, lambda k: stage_service_name(self.ctx, k),
                                  self.wiring, run.swarm, d_model=self.service.stage.config.d_model)
        refreshed = float("-inf")
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
            x, y = sampler.next_batch()
            loss = await trainer.step(x.long(), y.long())
            if loss is not None:
                self.losses.append(loss)
            if node.log_every_steps and len(self.losses) % node.log_every_steps == 0 and loss is not None:
                logger.info("swarm trainer: %d micro-batches, loss %.4f, %s", len(self.losses), loss,
                            self.wiring.stats)

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
        self.service = self._build_service(self.stage)
        await self.service.start(ctx.transport)
        logger.info("serving stage %d of %d as %s", self.stage, ctx.run.swarm.stages, ctx.peer_id)
        announcer = asyncio.ensure_future(self._announce_loop())
        rebalancer = asyncio.ensure_future(self._rebalance_loop())
        try:
            trains = self.trainer_wanted if self.trainer_wanted is not None else self.stage == 0
            if trains:
                await self._train()
            else:
                await ctx.stop.wait()
        finally:
            for task in (announcer, rebalancer):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await self.service.stop()
