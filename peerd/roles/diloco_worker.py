"""The data-parallel DiLoCo worker role: inner steps on local data, outer rounds with the swarm.

Life of a worker:

1. Resume from its local checkpoint if there is one, then *catch up*: if a live peer (seen through the status
   records in the DHT) is at a later outer round, download theta_outer and the outer momentum from it.
2. Loop: run inner AdamW steps until the round's quota (H, or what remains of the current round for a joiner);
   then form the round's group (key ``round<r>``) and butterfly-all-reduce the pseudo-gradient weighted by samples;
   apply the outer Nesterov step; reset theta_local to the new theta_outer; evaluate; checkpoint.
3. On SIGINT/SIGTERM: abandon matchmaking (or let a running all-reduce finish, bounded), checkpoint, leave.

When a round fails (no group in time, too few peers, a reducer died, the leader refused our state), theta_outer and
the outer momentum stay exactly as they were (:meth:`OuterState.apply` is never called), and theta_local is *not*
reset: the worker keeps training, and its next pseudo-gradient covers every step since the last successful round
(its weight counts all those samples). If the others completed the round without us, the status records show a
later round and the worker downloads that state before its next attempt, dropping its unsynchronized local steps
(logged with their count). A leader that sees a member with a different theta_outer digest refuses it; the refused
worker downloads the leader's state. So no two members of a group ever disagree on theta_outer.

While it downloads, a worker's status says ``role = "syncing"``, and the all-reduce peers count it in their round's
expected group size: they wait for it in matchmaking (bounded by ``matchmaking_timeout_s``) instead of sealing the
round without it. Otherwise a peer whose download takes longer than a round (a slow or capped uploader) would find
the swarm a round further every time it finished, and download again forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from peerd.checkpoint import Checkpoint, CheckpointError, checkpoint_path, load_checkpoint, save_checkpoint
from peerd.config import NodeConfig
from peerd.run_config import RunConfig
from peerd.faults import Faults, FaultyTransport
from peerd.data import DataError, WindowSampler, evaluate, load_corpus
from peerd.models import build_model
from peerd.pause import PauseGate
from peerd.telemetry import StatusFilter, make_status, status_key
from protocols.allreduce import AllReduceFailed, ButterflyAllReduce
from protocols.bans import BanList
from protocols.compression import all_finite
from protocols.gossip import GossipAverager
from protocols.diloco import (
    OuterState,
    flatten_parameters,
    inner_lr_at,
    load_flat_parameters_,
    make_inner_optimizer,
    set_lr,
)
from protocols.interfaces import Transport
from protocols.matchmaking import AdmissionRefused, Matchmaker, MatchmakingFailed
from protocols.moshpit import MoshpitAverager, round_to_join
from protocols.state_transfer import StateServer, StateSnapshot, StateTransferFailed, download_state
from protocols.wire import ProtocolViolation

logger = logging.getLogger(__name__)

ROLE = "diloco"
#: Status role of a worker downloading the swarm's state: it joins the round in progress right after.
SYNCING = "syncing"
#: An all-reduce that fails (a member died mid-round) is retried this many times in all, among the survivors.
MAX_ROUND_ATTEMPTS = 2
#: Longest a running all-reduce may delay a requested shutdown, in seconds.
SHUTDOWN_GRACE_S = 15.0


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device} requested but CUDA is not available on this machine")
    return torch.device(device)


@dataclass
class RoundStats:
    """Counters a worker reports (status records, logs, the demo's summary)."""

    rounds_ok: int = 0
    rounds_failed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    tokens: int = 0
    last_loss: Optional[float] = None
    last_eval: Optional[float] = None
    tokens_per_s: Optional[float] = None


class DiLoCoWorker:
    """One peer's DiLoCo training. ``run()`` returns when stopped or after ``max_outer_rounds``."""

    def __init__(self, run_id: str, run: RunConfig, node: NodeConfig, transport: Transport, stop: asyncio.Event,
                 gate: Optional[PauseGate] = None):
        self.run_id = run_id
        self.run = run
        self.node = node
        self.hp = run.diloco
        self.faults = Faults.from_env()
        if self.faults is not None:  # test-only: make this peer misbehave on schedule (see peerd/faults.py)
            transport = FaultyTransport.wrap(transport, self.faults)
        self.transport = transport
        self.stop = stop
        self.gate = gate or PauseGate()  # paused: no inner steps, no matchmaking (see _wait_while_paused)
        self._syncing = False  # downloading the swarm's state (status role SYNCING)
        self.peer_id = transport.streams.peer_id
        self.prefix = f"peerd.{run_id}"
        self.stats = RoundStats()
        self.device = pick_device(node.device)
        if node.threads:
            torch.set_num_threads(node.threads)

        if run.dataset == "local" and not node.data:
            raise DataError(f"run {run_id!r} trains on local data: pass --data PATH|GLOB")
        corpus = load_corpus(node.data or "shakespeare")
        self.eval_tokens = corpus.eval
        self.sampler = WindowSampler(corpus.train, run.seq_len, run.batch_size, seed=self.peer_id)
        self.model = build_model(run.model, run.seq_len, run.seed).to(self.device)
        self.outer = OuterState.initial(flatten_parameters(self.model))
        self.optimizer = make_inner_optimizer(self.model.parameters(), self.hp)
        self.steps_since_sync = 0
        self.samples_since_sync = 0
        self.round_quota = self.hp.inner_steps
        self._snapshot: Optional[StateSnapshot] = None
        self._snapshot_of: Optional[OuterState] = None
        self.checkpoint_file = checkpoint_path(node.checkpoint_path, run_id)

        self.round_start_theta = self.outer.theta
        self.method = run.averaging.method
        self.gossip_weight = float(run.batch_size * self.hp.inner_steps)
        self._gossip_bytes = (0, 0)  # the gossip averager's byte counters at our last round
        # only the all-reduce keeps theta_outer bit-identical, so only it refuses members that differ;
        # a run with an allowlist refuses unlisted members whatever the method
        admit = self._admit if self.method == "allreduce" or run.allowlist else None
        self._status_filter = StatusFilter(logger)
        self.bans = BanList(run.averaging.ban_s, on_ban=self._on_ban)
        self.matchmaker = Matchmaker(transport, self.prefix, run.averaging.matchmaking(), admit=admit, bans=self.bans)
        self.allreduce = ButterflyAllReduce(transport, self.prefix, run.averaging.allreduce(), bans=self.bans)
        self.moshpit = MoshpitAverager(self.matchmaker, self.allreduce, run.averaging.group_size)
        self.gossip = GossipAverager(transport, self.prefix, run.averaging.gossip(), self._gossip_state,
                                     self._set_gossip_state, bans=self.bans)
        self.state_server = StateServer(transport, self.prefix, self._current_snapshot)
        self.components = (self.matchmaker, self.allreduce, self.gossip, self.state_server)

    # ------------------------------------------------------------------------------------------------------ lifecycle

    async def run_forever(self) -> None:
        """Train until stopped or ``max_outer_rounds`` is reached; always checkpoints before returning."""
        for component in self.components:
            await component.start()
        self._resume()
        status_task = asyncio.ensure_future(self._publish_status_forever())
        try:
            await self._catch_up(await self._live_peers())
            await self._evaluate_and_log(event="eval", extra={"outer_round": self.outer.outer_round})
            while not self.stop.is_set() and not self._finished():
                await self._wait_while_paused()
                await self._train_until_quota()
                if self.stop.is_set():
                    break
                if self.gate.paused:
                    continue
                await self._outer_round()
        finally:
            status_task.cancel()
            with contextlib.suppress(BaseException):
                await status_task
            self._save_checkpoint()
            await self._publish_status(role="left")
            for component in self.components:
                with contextlib.suppress(Exception):
                    await component.stop()
        logger.info(
            "leaving run %s after %d outer rounds (%d failed); sent %.1f MB, received %.1f MB",
            self.run_id, self.outer.outer_round, self.stats.rounds_failed,
            self.stats.bytes_sent / 1e6, self.stats.bytes_received / 1e6,
            extra={"event": "leave", "outer_round": self.outer.outer_round, "bytes_sent": self.stats.bytes_sent,
                   "bytes_received": self.stats.bytes_received, "rounds_failed": self.stats.rounds_failed},
        )

    def _finished(self) -> bool:
        return bool(self.run.max_outer_rounds) and self.outer.outer_round >= self.run.max_outer_rounds

    # ---------------------------------------------------------------------------------------------------- inner steps

    def _inner_step(self) -> float:
        """One AdamW step on a fresh batch; runs in a worker thread. Returns the loss (nats/byte)."""
        global_step = self.outer.outer_round * self.hp.inner_steps + self.steps_since_sync
        set_lr(self.optimizer, inner_lr_at(global_step, self.hp))
        x, y = self.sampler.next_batch()  # (B, T), (B, T)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        _, loss = self.model(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.hp.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hp.grad_clip_norm)
        self.optimizer.step()
        return float(loss.detach())

    async def _train_until_quota(self) -> None:
        loop = asyncio.get_running_loop()
        tokens_per_step = self.run.batch_size * self.run.seq_len
        window_start, window_steps = time.perf_counter(), 0
        while self.steps_since_sync < self.round_quota and not self.stop.is_set() and not self.gate.paused:
            loss = await loop.run_in_executor(None, self._inner_step)
            self.steps_since_sync += 1
            self.samples_since_sync += self.run.batch_size
            self.stats.tokens += tokens_per_step
            self.stats.last_loss = loss
            window_steps += 1
            if window_steps == self.node.log_every_steps or self.steps_since_sync == self.round_quota:
                elapsed = time.perf_counter() - window_start
                self.stats.tokens_per_s = window_steps * tokens_per_step / max(elapsed, 1e-9)
                logger.info(
                    "round %d step %d/%d loss %.4f tokens/s %.0f",
                    self.outer.outer_round + 1, self.steps_since_sync, self.round_quota, loss, self.stats.tokens_per_s,
                    extra={"event": "inner", "outer_round": self.outer.outer_round, "inner_step": self.steps_since_sync,
                           "loss": loss, "tokens_per_s": self.stats.tokens_per_s},
                )
                window_start, window_steps = time.perf_counter(), 0

    # --------------------------------------------------------------------------------------------------- outer rounds

    def _on_ban(self, peer: str, reason: str) -> None:
        logger.warning("banned %s for %.0f s: %s", peer, self.bans.ban_s, reason,
                       extra={"event": "ban", "peer": peer, "reason": reason, "ban_s": self.bans.ban_s})

    def _admit(self, own_info: dict, peer: str, info: dict) -> Optional[str]:
        if self.run.allowlist and peer not in self.run.allowlist:
            return "not on the run's allowlist"
        if self.method == "allreduce" and info.get("digest") != own_info.get("digest"):
            return f"theta_outer digest {str(info.get('digest'))[:12]} differs from the leader's"
        return None

    async def _outer_round(self) -> None:
        """One outer round with the configured topology; on success theta_local restarts from theta_outer."""
        records = await self._peer_records()
        live = _workers(records)
        # all-reduce peers move in lockstep: anyone ahead means we missed a round. Moshpit groups progress
        # independently, so only a gap of two rounds means our groupmates are gone. Gossip has no rounds to share.
        margin = {"allreduce": 1, "moshpit": 2}.get(self.method)
        if margin is not None and await self._catch_up(live, margin):
            return
        started = time.perf_counter()
        if self.faults is not None:
            self.faults.round = self.outer.outer_round + 1
        if self.method == "allreduce":
            syncing = sum(1 for p, v in records.items() if p != self.peer_id and v.get("role") == SYNCING)
            outcome = await self._allreduce_round(live, syncing)
        elif self._diverged(flatten_parameters(self.model)):
            outcome = None
        else:
            outcome = await self._mixing_round(live)
        if outcome is None:
            return
        result, weight, steps_in_round, digest = outcome
        load_flat_parameters_(self.model, self.outer.theta)
        self.round_start_theta = self.outer.theta
        self.steps_since_sync, self.samples_since_sync = 0, 0
        self.round_quota = self.hp.inner_steps
        self.stats.rounds_ok += 1
        self.stats.bytes_sent += result["bytes_sent"]
        self.stats.bytes_received += result["bytes_received"]
        self._save_checkpoint()
        n = result["group_size"]
        dp_bytes = int(steps_in_round * 2 * (n - 1) / n * 4 * self.outer.numel)
        await self._evaluate_and_log(
            event="outer_round",
            extra={
                **result, "outer_round": self.outer.outer_round, "round_s": round(time.perf_counter() - started, 3),
                "weight": weight, "inner_steps": steps_in_round, "dp_equivalent_bytes": dp_bytes, "digest": digest,
                "method": self.method,
            },
        )
        await self._publish_status()

    def _round_failed(self, r: int, error: Exception, what: str) -> None:
        self.stats.rounds_failed += 1
        logger.warning(
            "round %d failed: %s; %s", r + 1, error, what,
            extra={"event": "round_failed", "outer_round": r, "reason": str(error), "method": self.method},
        )

    def _diverged(self, values: torch.Tensor) -> bool:
        """If ``values`` (local parameters or pseudo-gradient, (P,)) are not all finite, local training diverged: sit
        the round out (nobody can use our contribution, and the all-reduce would refuse it), drop the local steps
        and the inner optimizer's state, restart from theta_outer. Returns True in that case."""
        if all_finite(values):
            return False
        r = self.outer.outer_round
        self._round_failed(r, ValueError("local pseudo-gradient is not finite (local training diverged)"),
                           f"dropping {self.steps_since_sync} local steps and the inner optimizer state, restarting "
                           "from theta_outer")
        load_flat_parameters_(self.model, self.outer.theta)
        self.round_start_theta = self.outer.theta
        self.optimizer = make_inner_optimizer(self.model.parameters(), self.hp)
        self.steps_since_sync, self.samples_since_sync = 0, 0
        self.round_quota = self.hp.inner_steps
        return True

    async def _allreduce_round(self, live: dict[str, dict], syncing: int = 0) -> Optional[tuple[dict, float, int, str]]:
        """Average pseudo-gradients with everyone present, then apply the shared outer step (bit-identical).

        The group is sealed early once it has every live peer at our round plus the ``syncing`` peers (downloading
        the state to join this round); otherwise matchmaking waits out its timeout.

        If the all-reduce fails (a member died mid-round: its part is missing for everyone), the survivors retry the
        round once right away among themselves, with the same pseudo-gradients, under a fresh group key.
        """
        r = self.outer.outer_round
        expected = 1 + syncing + sum(1 for p, s in live.items() if p != self.peer_id and s.get("outer_round") == r)
        pseudo_gradient = self.outer.pseudo_gradient(flatten_parameters(self.model))  # (P,)
        weight = float(self.samples_since_sync)
        if self.faults is not None:
            pseudo_gradient = self.faults.transform_pseudo_gradient(pseudo_gradient)
        if self._diverged(pseudo_gradient):
            return None
        result = None
        for attempt in range(1, MAX_ROUND_ATTEMPTS + 1):
            key = f"round{r}" if attempt == 1 else f"round{r}.attempt{attempt}"
            try:
                if self.faults is not None:
                    self.faults.at_phase("matchmaking")
                group = await self._unless_stopped(
                    self.matchmaker.form_group(key, {"digest": self.outer.digest()}, expected_size=expected)
                )
                if group is None:
                    return None
                if self.faults is not None and self.faults.fail_now():
                    raise AllReduceFailed("injected failure")
                result = await self._bounded_on_stop(self.allreduce.run(group, pseudo_gradient, weight))
                break
            except AdmissionRefused as e:
                logger.warning("round %d: %s; adopting the leader's state after its round", r + 1, e.reason)
                await self._wait_for_round(e.leader, r + 1)
                await self._download_from([e.leader])
                return None
            except AllReduceFailed as e:
                if attempt < MAX_ROUND_ATTEMPTS and not self.stop.is_set():
                    logger.warning("round %d all-reduce failed (%s); retrying among the survivors", r + 1, e)
                    expected = max(1, len(group.members) - 1)
                    continue
                self._round_failed(r, e, f"theta_outer unchanged, keeping {self.steps_since_sync} local steps")
                self.round_quota = self.steps_since_sync + self.hp.inner_steps
                return None
            except (MatchmakingFailed, asyncio.TimeoutError) as e:
                self._round_failed(r, e, f"theta_outer unchanged, keeping {self.steps_since_sync} local steps")
                self.round_quota = self.steps_since_sync + self.hp.inner_steps
                return None
        if result is None:
            return None
        steps = self.steps_since_sync
        self.outer = self.outer.apply(result.averaged, self.hp)
        info = {"group_size": result.group_size, "bytes_sent": result.bytes_sent,
                "bytes_received": result.bytes_received, "allreduce_s": round(result.seconds, 3),
                "excluded": result.excluded, "attempts": attempt}
        return info, weight, steps, self.outer.digest()

    async def _mixing_round(self, live: dict[str, dict]) -> Optional[tuple[dict, float, int, str]]:
        """moshpit / gossip: apply our own outer step, then average the outer state (theta_outer, momentum) with
        this round's grid group or random partners. A failed exchange keeps our own step (peers drift apart a little
        until the next successful one); they are pulled together again by later rounds."""
        r = self.outer.outer_round
        if self.method == "moshpit":
            rounds = {p: s["outer_round"] for p, s in live.items() if p != self.peer_id}
            joined = round_to_join(self.peer_id, rounds, r, self.run.averaging.group_size)
            if joined != r:
                logger.info("our moshpit groupmates moved on: joining round %d instead of %d", joined + 1, r + 1)
                self.outer = OuterState(self.outer.theta, self.outer.momentum, joined)
                r = joined
        weight = float(self.samples_since_sync)
        delta = self.round_start_theta - flatten_parameters(self.model)  # own pseudo-gradient (P,)
        stepped = self.outer.apply(delta, self.hp)  # onto the current state, which gossip may have mixed meanwhile
        stepped = OuterState(stepped.theta, stepped.momentum, r + 1)
        steps = self.steps_since_sync
        info = {"group_size": 1, "bytes_sent": 0, "bytes_received": 0, "allreduce_s": 0.0, "excluded": {}}
        started = time.perf_counter()
        peers = sorted(live) if self.peer_id in live else sorted([*live, self.peer_id])
        try:
            if self.method == "moshpit":
                packed = torch.cat([stepped.theta, stepped.momentum])  # (2P,)
                try:
                    result = await self._unless_stopped(self.moshpit.average(r, packed, weight, peers))
                finally:  # our status keeps showing round r until the group is done: others match with us
                    self.outer = stepped
                if result is not None:
                    self.outer = _unpack(result.averaged, r + 1)
                    info.update(group_size=result.group_size, bytes_sent=result.bytes_sent,
                                bytes_received=result.bytes_received, excluded=result.excluded)
            else:
                self.outer, self.gossip_weight = stepped, weight
                result = await self._unless_stopped(self.gossip.gossip_round(peers))
                if result is not None:
                    # bytes of exchanges we answered since our last round count too, not only those we started
                    sent, received = self.gossip.bytes_sent, self.gossip.bytes_received
                    info.update(group_size=1 + result.exchanges, bytes_sent=sent - self._gossip_bytes[0],
                                bytes_received=received - self._gossip_bytes[1])
                    self._gossip_bytes = (sent, received)
        except (MatchmakingFailed, AllReduceFailed) as e:
            self._round_failed(r, e, "keeping our own outer step")
        info["allreduce_s"] = round(time.perf_counter() - started, 3)
        return info, weight, steps, self.outer.digest()

    def _gossip_state(self) -> tuple[torch.Tensor, float]:
        return torch.cat([self.outer.theta, self.outer.momentum]), self.gossip_weight

    def _set_gossip_state(self, packed: torch.Tensor, weight: float) -> None:
        self.outer = _unpack(packed, self.outer.outer_round)
        self.gossip_weight = weight

    async def _unless_stopped(self, coro) -> Any:
        """Run ``coro`` but abandon it (returning None) as soon as a stop or a pause is requested."""
        task = asyncio.ensure_future(coro)
        stopper = asyncio.ensure_future(self.stop.wait())
        pauser = asyncio.ensure_future(self.gate.wait_paused())
        try:
            await asyncio.wait({task, stopper, pauser}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            pauser.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        logger.info("%s requested: abandoned matchmaking", "stop" if self.stop.is_set() else "pause")
        return None

    async def _wait_while_paused(self) -> None:
        """While the gate is paused: publish role "paused" (others stop counting on us), wait, then rejoin. Called
        only between rounds, so a pause never breaks a running all-reduce."""
        if not self.gate.paused or self.stop.is_set():
            return
        logger.info("paused (%s) at outer round %d, %d local steps", self.gate.describe(), self.outer.outer_round,
                    self.steps_since_sync, extra={"event": "paused", "outer_round": self.outer.outer_round,
                                                  "reasons": self.gate.reasons})
        await self._publish_status()
        resumed = asyncio.ensure_future(self.gate.wait_running())
        stopper = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({resumed, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            resumed.cancel()
            stopper.cancel()
        if self.stop.is_set():
            return
        logger.info("resumed at outer round %d", self.outer.outer_round,
                    extra={"event": "resumed", "outer_round": self.outer.outer_round})
        await self._publish_status()
        await self._catch_up(await self._live_peers())  # before training: steps on a stale state would be dropped

    async def _bounded_on_stop(self, coro) -> Any:
        """Run ``coro``; if a stop is requested meanwhile, give it at most SHUTDOWN_GRACE_S more seconds."""
        task = asyncio.ensure_future(coro)
        stopper = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if not task.done():
            done, _ = await asyncio.wait({task}, timeout=SHUTDOWN_GRACE_S)
            if not done:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                logger.info("stop requested: abandoned the running all-reduce")
                return None
        return task.result()

    # ------------------------------------------------------------------------------------------------ catching up

    async def _peer_records(self) -> dict[str, dict]:
        """Status records of this run's peers, any role (PeerID -> record). The daemon's discovery returns only
        records signed by their owner (peerd.transport.records); records with the wrong schema are dropped here."""
        return self._status_filter(await self.transport.discovery.get(status_key(self.run_id)))

    async def _live_peers(self) -> dict[str, dict]:
        """Status records of live, training workers of this run (role ``diloco``; PeerID -> record)."""
        return _workers(await self._peer_records())

    async def _catch_up(self, live: dict[str, dict], margin: int = 1) -> bool:
        """Download the state of the most advanced live peer if it is ``margin`` or more rounds ahead of us.
        True if we adopted a state."""
        mine = self.outer.outer_round
        ahead = sorted(
            ((s["outer_round"], p) for p, s in live.items() if p != self.peer_id and s["outer_round"] >= mine + margin),
            reverse=True,
        )
        if not ahead:
            return False
        adopted = await self._download_from([p for _, p in ahead])
        if adopted:
            # join the round in progress: do only what the others still have to do
            in_round = [s.get("inner_step") or 0 for s in live.values() if s["outer_round"] == self.outer.outer_round]
            self.round_quota = max(1, self.hp.inner_steps - max(in_round, default=0))
        return adopted

    async def _wait_for_round(self, peer: str, outer_round: int) -> None:
        """Wait (bounded by the round's timeouts) until ``peer``'s status shows ``outer_round``: the leader that
        refused us is finishing that round right now, and its state after the round is the one worth adopting."""
        loop = asyncio.get_running_loop()
        averaging = self.run.averaging
        deadline = loop.time() + averaging.matchmaking_timeout_s + averaging.reducer_timeout_s
        while loop.time() < deadline and not self.stop.is_set():
            status = (await self._live_peers()).get(peer)
            if status is None or status["outer_round"] >= outer_round:
                return
            await asyncio.sleep(min(1.0, self.node.status_interval_s))

    async def _download_from(self, peers: list[str]) -> bool:
        """Adopt the outer state of the first of ``peers`` that serves a valid one; False if none did. Our status
        says SYNCING meanwhile, so that peers ahead wait for us in their round."""
        self._syncing = True
        await self._publish_status()
        try:
            return await self._download_first(peers)
        finally:
            self._syncing = False

    async def _download_first(self, peers: list[str]) -> bool:
        expected = {"theta": (torch.float32, self.outer.numel), "momentum": (torch.float32, self.outer.numel)}
        max_bytes = 2 * 4 * self.outer.numel
        timeout = self.run.averaging.reducer_timeout_s
        for peer in peers:
            started = time.perf_counter()
            try:
                snapshot = await download_state(self.transport, self.prefix, peer, max_bytes, timeout)
                tensors = snapshot.tensors(expected)
                meta = snapshot.metadata
                outer = OuterState(tensors["theta"], tensors["momentum"], int(meta.get("outer_round", -1)))
                if meta.get("digest") != outer.digest():
                    raise ProtocolViolation("state digest does not match its tensors")
            except (StateTransferFailed, ProtocolViolation, ValueError, TypeError) as e:
                logger.warning("state download from %s failed: %s", peer, e)
                continue
            dropped = self.steps_since_sync
            self.outer = outer
            load_flat_parameters_(self.model, outer.theta)
            self.steps_since_sync, self.samples_since_sync = 0, 0
            self.round_quota = self.hp.inner_steps
            self.round_start_theta = outer.theta
            self._syncing = False
            await self._publish_status()
            logger.info(
                "downloaded outer round %d state (%.1f MB) from %s in %.2f s%s",
                outer.outer_round, len(snapshot.payload) / 1e6, peer, time.perf_counter() - started,
                f"; dropped {dropped} unsynchronized local steps" if dropped else "",
                extra={"event": "state_download", "outer_round": outer.outer_round, "peer": peer,
                       "digest": outer.digest(), "seconds": time.perf_counter() - started},
            )
            return True
        return False

    def _current_snapshot(self) -> StateSnapshot:
        """The outer state as served to joiners, rebuilt only when the state object changed."""
        if self._snapshot is None or self._snapshot_of is not self.outer:
            self._snapshot_of = self.outer
            self._snapshot = StateSnapshot.from_tensors(
                {"theta": self.outer.theta, "momentum": self.outer.momentum},
                {"outer_round": self.outer.outer_round, "digest": self.outer.digest(), "run": self.run.fingerprint()},
            )
        return self._snapshot

    # ------------------------------------------------------------------------------------------ evaluation, status

    async def _evaluate_and_log(self, event: str, extra: dict[str, Any]) -> None:
        eval_loss = None
        if self.run.eval_batches:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(
                None,
                lambda: evaluate(self.model, self.eval_tokens, self.run.seq_len, self.run.batch_size,
                                 self.run.eval_batches),
            )
            eval_loss = result.nats_per_byte
            self.stats.last_eval = eval_loss
        extra = {**extra, "event": event, "eval_nats_per_byte": eval_loss, "tokens": self.stats.tokens}
        if event == "outer_round":
            logger.info(
                "outer round %d done: group %d, sent %.2f MB, received %.2f MB, all-reduce %.2f s, eval %s",
                extra["outer_round"], extra["group_size"], extra["bytes_sent"] / 1e6, extra["bytes_received"] / 1e6,
                extra["allreduce_s"], _fmt_eval(eval_loss), extra=extra,
            )
        else:
            logger.info("outer round %d: eval %s", extra["outer_round"], _fmt_eval(eval_loss), extra=extra)

    async def _publish_status(self, role: Optional[str] = None) -> None:
        role = role or ("paused" if self.gate.paused else SYNCING if self._syncing else ROLE)
        record = make_status(
            role=role, outer_round=self.outer.outer_round, inner_step=self.steps_since_sync,
            loss=self.stats.last_loss, tokens_per_s=self.stats.tokens_per_s,
            eval_nats_per_byte=self.stats.last_eval, digest=self.outer.digest()[:16],
        )
        discovery = self.transport.discovery
        with contextlib.suppress(Exception):
            await discovery.store(status_key(self.run_id), self.peer_id, record,
                                  discovery.time() + self.node.status_ttl_s)

    async def _publish_status_forever(self) -> None:
        while True:
            await self._publish_status()
            await asyncio.sleep(self.node.status_interval_s)

    # ----------------------------------------------------------------------------------------------------- checkpoint

    def _save_checkpoint(self) -> None:
        tensors = {"theta_outer": self.outer.theta, "momentum": self.outer.momentum,
                   "theta_local": flatten_parameters(self.model)}
        inner_state = self.optimizer.state_dict()["state"]
        for index, state in inner_state.items():
            for name, value in state.items():
                tensors[f"inner.{index}.{name}"] = torch.as_tensor(value).detach().cpu()
        metadata = {
            "run_id": self.run_id, "run_fingerprint": self.run.fingerprint(), "outer_round": self.outer.outer_round,
            "steps_since_sync": self.steps_since_sync, "samples_since_sync": self.samples_since_sync,
            "round_quota": self.round_quota, "sampler": self.sampler.state_dict(), "tokens": self.stats.tokens,
        }
        try:
            hook = (lambda: self.faults.at_phase("checkpoint")) if self.faults is not None else None
            save_checkpoint(self.checkpoint_file, Checkpoint(tensors, metadata), before_rename=hook)
        except OSError as e:
            logger.error("could not write checkpoint %s: %s", self.checkpoint_file, e)

    def _resume(self) -> None:
        checkpoint = load_checkpoint(self.checkpoint_file)
        if checkpoint is None:
            return
        meta = checkpoint.metadata
        if meta.get("run_fingerprint") != self.run.fingerprint():
            raise CheckpointError(
                f"checkpoint {self.checkpoint_file} was written under another configuration of run {self.run_id!r};"
                " move it away or use another --checkpoint-dir"
            )
        t = checkpoint.tensors
        try:
            self.outer = OuterState(t["theta_outer"].clone(), t["momentum"].clone(), int(meta["outer_round"]))
            self.round_start_theta = self.outer.theta
            load_flat_parameters_(self.model, t["theta_local"])
            state = self.optimizer.state_dict()
            inner: dict[int, dict[str, torch.Tensor]] = {}
            for name, value in t.items():
                if name.startswith("inner."):
                    _, index, key = name.split(".", 2)
                    inner.setdefault(int(index), {})[key] = value.to(self.device) if key != "step" else value
            state["state"] = inner
            self.optimizer.load_state_dict(state)
            self.sampler.load_state_dict(meta["sampler"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {self.checkpoint_file} is incomplete or mismatched: {e}") from None
        self.steps_since_sync = int(meta["steps_since_sync"])
        self.samples_since_sync = int(meta["samples_since_sync"])
        self.round_quota = int(meta["round_quota"])
        self.stats.tokens = int(meta.get("tokens", 0))
        logger.info(
            "resumed from %s: outer round %d, %d local steps since the last sync",
            self.checkpoint_file, self.outer.outer_round, self.steps_since_sync,
            extra={"event": "resume", "outer_round": self.outer.outer_round, "digest": self.outer.digest()},
        )


def _unpack(packed: torch.Tensor, outer_round: int) -> OuterState:
    """(2P,) = [theta_outer, momentum] back into an OuterState (validated: shapes, finite values)."""
    numel = packed.numel() // 2
    return OuterState(packed[:numel].clone(), packed[numel:].clone(), outer_round)


def _fmt_eval(nats: Optional[float]) -> str:
    if nats is None:
        return "off"
    return f"{nats:.4f} nats/byte ({nats / 0.6931471805599453:.4f} bits/byte)"


def _workers(records: dict[str, dict]) -> dict[str, dict]:
    """The records of training workers (role ``diloco`` with an outer round) among status records."""
    return {peer: value for peer, value in records.items()
            if value.get("role") == ROLE and isinstance(value.get("outer_round"), int)}
