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
from peerd.config import NodeConfig, RunConfig
from peerd.data import DataError, WindowSampler, evaluate, load_corpus
from peerd.models import build_model
from peerd.telemetry import make_status, status_key
from protocols.allreduce import AllReduceFailed, ButterflyAllReduce
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
from protocols.state_transfer import StateServer, StateSnapshot, StateTransferFailed, download_state
from protocols.wire import ProtocolViolation

logger = logging.getLogger(__name__)

ROLE = "diloco"
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

    def __init__(self, run_id: str, run: RunConfig, node: NodeConfig, transport: Transport, stop: asyncio.Event):
        self.run_id = run_id
        self.run = run
        self.node = node
        self.hp = run.diloco
        self.transport = transport
        self.stop = stop
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
        self.checkpoint_file = checkpoint_path(node.checkpoint_path, run_id)

        self.matchmaker = Matchmaker(transport, self.prefix, run.averaging.matchmaking(), admit=self._admit)
        self.allreduce = ButterflyAllReduce(transport, self.prefix, run.averaging.allreduce())
        self.state_server = StateServer(transport, self.prefix, lambda: self._snapshot)

    # ------------------------------------------------------------------------------------------------------ lifecycle

    async def run_forever(self) -> None:
        """Train until stopped or ``max_outer_rounds`` is reached; always checkpoints before returning."""
        for component in (self.matchmaker, self.allreduce, self.state_server):
            await component.start()
        self._resume()
        self._refresh_snapshot()
        status_task = asyncio.ensure_future(self._publish_status_forever())
        try:
            await self._catch_up(await self._live_peers())
            await self._evaluate_and_log(event="eval", extra={"outer_round": self.outer.outer_round})
            while not self.stop.is_set() and not self._finished():
                await self._train_until_quota()
                if self.stop.is_set():
                    break
                await self._outer_round()
        finally:
            status_task.cancel()
            with contextlib.suppress(BaseException):
                await status_task
            self._save_checkpoint()
            await self._publish_status(role="left")
            for component in (self.matchmaker, self.allreduce, self.state_server):
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
        while self.steps_since_sync < self.round_quota and not self.stop.is_set():
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

    def _admit(self, own_info: dict, peer: str, info: dict) -> Optional[str]:
        if info.get("digest") != own_info.get("digest"):
            return f"theta_outer digest {str(info.get('digest'))[:12]} differs from the leader's"
        return None

    async def _outer_round(self) -> None:
        live = await self._live_peers()
        if await self._catch_up(live):
            return
        r = self.outer.outer_round
        expected = 1 + sum(1 for p, s in live.items() if p != self.peer_id and s.get("outer_round") == r)
        theta_local = flatten_parameters(self.model)
        pseudo_gradient = self.outer.pseudo_gradient(theta_local)  # (P,)
        weight = float(self.samples_since_sync)
        round_start = time.perf_counter()
        try:
            group = await self._unless_stopped(
                self.matchmaker.form_group(f"round{r}", {"digest": self.outer.digest()}, expected_size=expected)
            )
            if group is None:
                return
            result = await self._bounded_on_stop(self.allreduce.run(group, pseudo_gradient, weight))
        except AdmissionRefused as e:
            logger.warning("round %d: %s; adopting the leader's state after its round", r + 1, e.reason)
            await self._wait_for_round(e.leader, r + 1)
            await self._download_from([e.leader])
            return
        except (MatchmakingFailed, AllReduceFailed, asyncio.TimeoutError) as e:
            self.stats.rounds_failed += 1
            logger.warning(
                "round %d failed: %s; theta_outer unchanged, keeping %d local steps for the next attempt",
                r + 1, e, self.steps_since_sync,
                extra={"event": "round_failed", "outer_round": r, "reason": str(e)},
            )
            self.round_quota = self.steps_since_sync + self.hp.inner_steps
            return
        if result is None:
            return
        new_outer = self.outer.apply(result.averaged, self.hp)
        load_flat_parameters_(self.model, new_outer.theta)
        self.outer = new_outer
        steps_in_round = self.steps_since_sync
        self.steps_since_sync, self.samples_since_sync = 0, 0
        self.round_quota = self.hp.inner_steps
        self.stats.rounds_ok += 1
        self.stats.bytes_sent += result.bytes_sent
        self.stats.bytes_received += result.bytes_received
        self._refresh_snapshot()
        self._save_checkpoint()
        params = pseudo_gradient.numel()
        n = result.group_size
        dp_bytes = int(steps_in_round * 2 * (n - 1) / n * 4 * params)
        await self._evaluate_and_log(
            event="outer_round",
            extra={
                "outer_round": self.outer.outer_round, "group_size": n, "bytes_sent": result.bytes_sent,
                "bytes_received": result.bytes_received, "allreduce_s": round(result.seconds, 3),
                "round_s": round(time.perf_counter() - round_start, 3), "weight": weight,
                "inner_steps": steps_in_round, "dp_equivalent_bytes": dp_bytes, "digest": self.outer.digest(),
                "excluded": result.excluded,
            },
        )
        await self._publish_status()

    async def _unless_stopped(self, coro) -> Any:
        """Run ``coro`` but abandon it (returning None) as soon as a stop is requested."""
        task = asyncio.ensure_future(coro)
        stopper = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        logger.info("stop requested: abandoned matchmaking")
        return None

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

    async def _live_peers(self) -> dict[str, dict]:
        """Status records of live workers of this run (PeerID -> record)."""
        records = await self.transport.discovery.get(status_key(self.run_id))
        return {
            peer: r.value for peer, r in records.items()
            if isinstance(r.value, dict) and r.value.get("role") == ROLE and isinstance(r.value.get("outer_round"), int)
        }

    async def _catch_up(self, live: dict[str, dict]) -> bool:
        """Download the state of the most advanced live peer if it is ahead of us. True if we adopted a state."""
        ahead = sorted(
            ((s["outer_round"], p) for p, s in live.items() if p != self.peer_id and s["outer_round"] > self.outer.outer_round),
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
            self._refresh_snapshot()
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

    def _refresh_snapshot(self) -> None:
        self._snapshot = StateSnapshot.from_tensors(
            {"theta": self.outer.theta, "momentum": self.outer.momentum},
            {"outer_round": self.outer.outer_round, "digest": self.outer.digest(), "run": self.run.fingerprint()},
        )

    # ------------------------------------------------------------------------------------------ evaluation, status

    async def _evaluate_and_log(self, event: str, extra: dict[str, Any]) -> None:
        eval_loss = None
        if self.run.eval_batches:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(
                None,
                lambda: evaluate(self.model, self.eval_tokens, self.run.seq_len, self.run.batch_size,
                                 self.run.eval_batches, device=str(self.device)),
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

    async def _publish_status(self, role: str = ROLE) -> None:
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
            save_checkpoint(self.checkpoint_file, Checkpoint(tensors, metadata))
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


def _fmt_eval(nats: Optional[float]) -> str:
    if nats is None:
        return "off"
    return f"{nats:.4f} nats/byte ({nats / 0.6931471805599453:.4f} bits/byte)"
