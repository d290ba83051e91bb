"""The SPES role (arXiv 2602.11543): train a mixture-of-experts model where each peer trains the shared parameters
and its own experts only, synchronized peer to peer every ``[spes] sync_steps`` inner steps.

Life of a peer:

1. Read the live peers' expert claims from the DHT (key ``spes_claims`` of the run, one record per PeerID), claim
   its own experts (:func:`protocols.spes.claim_experts`: fewest live holders first, fair share of its capacity) and
   publish the claim. A peer that finds others already past round 0 first downloads the whole model from one of
   them (the latest synced state).
2. Loop: ``sync_steps`` AdamW steps on the shared parameters and its experts (the other experts frozen:
   :func:`peerd.models.local_experts.train_only_experts`), with the expert-merging warm-up every
   ``merge_interval`` steps; then a sparse sync (:class:`peerd.roles.spes_sync.SparseSync`), a re-claim
   (:func:`protocols.spes.rebalance` over the claims of the round's peers, so all of them agree), evaluation. A
   leaver's experts have no holder in the next round's view and are claimed first, from their latest synced copy,
   which every peer holds after the refresh.
3. On stop: checkpoint, publish ``left``, stop serving.

Checkpoints (the node's checkpoint file of the run, written after every sync and on stop): every parameter, this
peer's AdamW state, its claim, outer round, step counters and sampler position. A restarted peer resumes from it
(:class:`peerd.events.CheckpointResumed`), keeps its claim where the live claims allow, and still adopts a live
peer's model if that peer is past its round. Claim changes are :class:`peerd.events.ExpertsClaimed` events;
``RoundDone.bytes_sent`` is the all-reduce's bytes plus the expert refreshes served to the round's members.

The inner optimizer keeps its state for parameters that stay trained across a re-claim; newly claimed experts start
with fresh AdamW moments.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from typing import Optional

import torch

from peerd.worker.checkpoint_file import Checkpoint, CheckpointError, load_optimizer_tensors, optimizer_tensors
from peerd.events import CheckpointResumed, ExpertsClaimed, InnerProgress, RoundDone, RoundFailed, StateDownloaded
from peerd.worker.inner_step import InnerStep
from peerd.models import build_model
from peerd.models.local_experts import train_only_experts
from peerd.models.moe import MoETransformer, expert_parameter_names, shared_parameter_names
from peerd.roles.base import RunContext, unless_stopped
from peerd.roles.spes_sync import SparseSync
from peerd.roles.state_sync import StateSync
from peerd.worker.core import WorkerCore
from protocols.diloco import inner_lr_at, make_inner_optimizer, set_lr
from protocols.group_keys import RETRIES_FIELD
from protocols.spes import (PeerClaim, claim_experts, claim_record, expert_capacity, merge_alpha,
                            merge_due, merge_experts, parse_claim, rebalance)
from protocols.state_transfer import StateSnapshot
from protocols.wire import ProtocolViolation

logger = logging.getLogger(__name__)

ROLE = "spes"
#: DHT key (in the run's namespace) of the peers' expert claims; subkey = PeerID.
CLAIMS_KEY = "spes_claims"
#: Longest a peer waits after its round for the members refreshing from it to download, so that the round's
#: ``RoundDone.bytes_sent`` includes those answers (seconds; a download that comes later counts only in the totals).
REFRESH_ACCOUNTING_WAIT_S = 5.0
#: fp32 gradient + AdamW's two moments, bytes per trained parameter.
TRAINING_BYTES_PER_PARAMETER = 12


class SpesRole(WorkerCore):
    """One peer's SPES training. ``run()`` returns when stopped or after ``max_outer_rounds`` syncs."""

    name = ROLE

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        run = ctx.run
        self.cfg = run.spes
        model = build_model(run.model, run.seq_len, run.seed, ctx.tokenizer.vocab_size)
        if not isinstance(model, MoETransformer):
            raise ValueError(f"parallelism 'spes' needs a mixture-of-experts model, got {run.model!r}")
        self.model = model.to(self.device)
        self.n_experts = model.config.n_experts
        self._check_inner_step()
        self.inner_step: Optional[InnerStep] = None
        self.capacity = self._capacity()
        self.own: frozenset[int] = frozenset()
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.outer_round = 0
        self.global_step = 0
        self.steps_since_sync = 0
        self.samples_since_sync = 0
        # refresh answers go out after a holder's own sync returns: each RoundDone counts those of its round; the
        # total of those, to add the stragglers to the totals on leaving
        self._served_counted = 0
        self.refresh_bytes_received = 0
        #: the latest sync's :class:`peerd.roles.spes_sync.SparseSyncReport` (None before the first)
        self.last_report = None
        #: the members of the latest round this peer synced (PeerIDs)
        self._round_members: frozenset[str] = frozenset()
        self.claims_key = ctx.namespace.dht_key(CLAIMS_KEY)
        averaging = run.averaging
        self.sync = SparseSync(ctx.transport, ctx.namespace, ROLE, self.model, (), averaging.matchmaking(),
                               averaging.allreduce(), bans=ctx.bans,
                               refresh_timeout_s=averaging.state_transfer().download_timeout_s)
        self._model_snapshot: Optional[StateSnapshot] = None
        self.state_sync = StateSync(ctx.transport, ctx.namespace.scoped(fragment="model").prefix(ROLE),
                                    lambda: self._model_snapshot, averaging.state_transfer().download_timeout_s)
        self.components = (self.sync, self.state_sync)

    def _capacity(self) -> int:
        """Experts this peer can train: ``[spes] experts_per_peer`` if set, else all; on CUDA also what fits in 80%
        of the free device memory next to the shared parameters' training state."""
        cap = self.cfg.experts_per_peer or self.n_experts
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            shared = sum(self.model.get_parameter(n).numel() for n in shared_parameter_names(self.model))
            expert = sum(self.model.get_parameter(n).numel() for n in expert_parameter_names(self.model, 0))
            cap = min(cap, expert_capacity(int(0.8 * free), TRAINING_BYTES_PER_PARAMETER * shared,
                                           TRAINING_BYTES_PER_PARAMETER * expert))
        return cap

    # ------------------------------------------------------------------------------------------------------ lifecycle

    async def join(self) -> None:
        view = await self.claims_view()
        await self.catch_up(view)
        self.set_own(self._claim(await self.claims_view()))
        await self.publish_claim()
        await self.evaluate_and_publish()

    async def train_until_quota(self) -> None:
        """The inner steps left before the next sync (``sync_steps`` since the last one)."""
        await self.train_steps(self.cfg.sync_steps - self.steps_since_sync)

    async def run_round(self) -> None:
        await self.sync_round()

    async def _status_loop(self) -> None:
        await self._publish_loop()

    def _save_final_checkpoint(self) -> None:
        if self.optimizer is not None:  # None: stopped before it claimed anything (or resuming failed)
            self.save_checkpoint()

    async def _after_left(self) -> None:
        await self.publish_claim(left=True)

    async def _after_stop(self) -> None:
        # refresh answers served after the last RoundDone still count in the totals
        self.stats.bytes_sent += self.sync.refresh_bytes_served - self._served_counted
        self._served_counted = self.sync.refresh_bytes_served

    async def _on_pause(self) -> None:
        # the claim published as left: the others neither wait for this peer nor count it as a holder
        await self.publish_claim()

    async def _on_resume(self) -> None:
        # adopt the model of a peer that went past our round, re-claim, publish
        await self.catch_up(await self.claims_view())
        self.set_own(self._claim(await self.claims_view()))
        await self.publish_claim()
        await self.ctx.status.publish()

    # ------------------------------------------------------------------------------------------------- expert claims

    async def claims_view(self) -> dict[str, tuple[PeerClaim, int]]:
        """Live peers' claims (PeerID -> (claim, outer_round)), this peer excluded; malformed records dropped."""
        return (await self._read_claims())[0]

    async def _read_claims(self) -> tuple[dict[str, tuple[PeerClaim, int]], set[str]]:
        """:meth:`claims_view` and the PeerIDs whose record says they left."""
        try:
            found = await self.ctx.transport.discovery.get(self.claims_key)
        except ConnectionError as e:  # a DHT hiccup (DiscoveryError): no view this time, the next sync reads again
            logger.info("could not read expert claims: %s", e)
            return {}, set()
        out, left = {}, set()
        for peer, record in found.items():
            if isinstance(record.value, dict) and record.value.get("left") is True:
                left.add(peer)
                continue
            parsed = parse_claim(record.value, self.n_experts)
            if peer != self.peer_id and parsed is not None and not self.ctx.bans.is_banned(peer):
                out[peer] = parsed
        return out, left

    def _round_peers(self, r: int, view: dict[str, tuple[PeerClaim, int]], left: set[str]) -> set[str]:
        """Who should sync the shared parameters in round ``r``, this peer included: the peers whose published claim
        is at round ``r``, and the members of our previous round that have not left and are not elsewhere (their
        new claim may not be readable yet; counting them keeps the group from sealing without them)."""
        peers = {p for p, (_, rr) in view.items() if rr == r}
        peers |= {p for p in self._round_members if p not in left and (p not in view or view[p][1] in (r - 1, r))}
        peers.discard(self.peer_id)
        return peers | {self.peer_id}

    def _claim(self, view: dict[str, tuple[PeerClaim, int]]) -> frozenset[int]:
        others = {p: claim for p, (claim, _) in view.items()}
        return claim_experts(self.peer_id, self.n_experts, others, self.capacity, self.cfg.min_holders,
                             self.cfg.experts_per_peer, self.own)

    def set_own(self, own: frozenset[int]) -> None:
        """Train ``own`` from now on; AdamW state is kept for every parameter that stays trained."""
        if own == self.own and self.optimizer is not None:
            return
        if own != self.own:
            self.ctx.events.publish(ExpertsClaimed(self.outer_round, tuple(sorted(own)), tuple(sorted(self.own))))
        old = self.optimizer
        trainable = train_only_experts(self.model, own)
        self.optimizer = make_inner_optimizer(trainable, self.hp)
        self.inner_step = InnerStep(self.model, self.optimizer, batch_size=self.run_cfg.batch_size,
                                    micro_batch_size=self.ctx.node.micro_batch_size, precision=self.precision,
                                    grad_clip_norm=self.hp.grad_clip_norm)
        if old is not None:
            for p in trainable:
                if p in old.state:
                    self.optimizer.state[p] = old.state[p]
        for p in self.model.parameters():
            if not p.requires_grad:
                p.grad = None
        self.own = own
        self.sync.set_own(own)

    async def publish_claim(self, left: bool = False) -> None:
        """Publish this peer's claim; as left when ``left`` or while paused."""
        left = left or self.ctx.gate.paused
        discovery = self.ctx.transport.discovery
        with contextlib.suppress(ConnectionError):  # the DHT unreachable now: the next claim comes soon
            await discovery.store(self.claims_key, self.peer_id,
                                  claim_record(self.own, self.capacity, self.outer_round, left),
                                  discovery.time() + self.ctx.node.status_ttl_s)

    async def _publish_loop(self) -> None:
        while True:
            await self.publish_claim()
            with contextlib.suppress(ConnectionError):  # the DHT unreachable now: read again next time
                await self.ctx.status.records()
            await self.ctx.status.publish()
            await asyncio.sleep(self.ctx.node.status_interval_s)

    # ---------------------------------------------------------------------------------------------------- inner steps

    def _inner_step(self) -> float:
        set_lr(self.optimizer, inner_lr_at(self.global_step, self.hp))
        x, y = self.sampler.next_batch()  # (B, T), (B, T)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        loss = self.inner_step(x, y)  # frozen experts have no gradient: clipping and the step skip them
        self.global_step += 1
        if merge_due(self.global_step, self.cfg):
            self.merge_own_experts(merge_alpha(self.global_step, self.cfg.alpha_0, self.cfg.merge_decay_steps))
        return float(loss.detach())

    @torch.no_grad()
    def merge_own_experts(self, alpha: float) -> None:
        """The merging warm-up on this peer's experts (the others are refreshed from their holders at the sync):
        per layer, similarity on each expert's gate matrix (w1)."""
        for block in self.model.blocks:
            experts = block.moe.experts
            theta = torch.stack([torch.cat([p.reshape(-1) for p in e.parameters()]) for e in experts])  # (E, P)
            w1 = torch.stack([e.gate.weight.reshape(-1) for e in experts])  # (E, Q)
            merged = merge_experts(theta, alpha, self.cfg.merge_top_k, similarity_on=w1)
            for i in self.own:
                offset = 0
                for p in experts[i].parameters():
                    p.copy_(merged[i, offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    async def train_steps(self, steps: int) -> None:
        loop = asyncio.get_running_loop()
        tokens_per_step = self.run_cfg.batch_size * self.run_cfg.seq_len
        window_start, window_steps = time.perf_counter(), 0
        for _ in range(max(0, steps)):
            if self.ctx.stop.is_set() or self.ctx.gate.paused:
                return
            if not await self.sampler.ready():  # the next shard not fetched yet, and stopped meanwhile
                return
            loss = await loop.run_in_executor(None, self._inner_step)
            self.steps_since_sync += 1
            self.samples_since_sync += self.run_cfg.batch_size
            self.stats.tokens += tokens_per_step
            self.stats.last_loss = loss
            window_steps += 1
            if window_steps == self.ctx.node.log_every_steps or self.steps_since_sync == self.cfg.sync_steps:
                self.stats.tokens_per_s = window_steps * tokens_per_step / max(time.perf_counter() - window_start,
                                                                               1e-9)
                self.ctx.events.publish(InnerProgress(self.outer_round, self.steps_since_sync, loss,
                                                      self.stats.tokens_per_s, self.cfg.sync_steps))
                window_start, window_steps = time.perf_counter(), 0

    # --------------------------------------------------------------------------------------------------------- syncs

    async def sync_round(self) -> None:
        """Sparse sync of round ``outer_round``; then every member re-claims from the claims the round's group
        carried (:attr:`SparseSyncReport.claims`), the same on all of them."""
        started = time.perf_counter()
        r = self.outer_round
        view, left = await self._read_claims()
        if any(rr > r for _, rr in view.values()):
            # the others synced round r without us (our round failed): their model, not ours, is round r's result
            await self.catch_up(view)
            if self.outer_round > r:
                self.set_own(self._claim(await self.claims_view()))
                await self.publish_claim()
                return
        report = await unless_stopped(
            self.ctx, self.sync.sync(r, len(self._round_peers(r, view, left)),
                                     float(max(1, self.samples_since_sync)), self.capacity,
                                     await self._retry_records()), "sparse sync")
        if report is None:
            return
        self.last_report = report
        if "shared" in report.failed:
            self.stats.rounds_failed += 1
            await self.ctx.status.publish()  # our failed try, so that peers that missed it join the next one
            self.ctx.events.publish(RoundFailed(r, report.failed["shared"], ROLE,
                                                f"keeping {self.steps_since_sync} local steps"))
            return
        for name, reason in report.failed.items():
            logger.warning("round %d: %s not synced (%s); kept local values", r + 1, name, reason)
        steps, weight = self.steps_since_sync, float(self.samples_since_sync)
        self.outer_round += 1
        self.steps_since_sync = self.samples_since_sync = 0
        self.stats.rounds_ok += 1
        self.stats.bytes_received += report.allreduce_bytes_received + report.refresh_bytes_received
        self.refresh_bytes_received += report.refresh_bytes_received
        self.snapshot_model()
        # every member re-claims from the same claims (this round's): they agree on who trains what next
        self._round_members = frozenset(report.claims)
        self.set_own(rebalance(self.n_experts, report.claims, self.cfg.min_holders,
                                self.cfg.experts_per_peer)[self.peer_id])
        await self.publish_claim()
        self.save_checkpoint()
        eval_loss = await self.evaluate()
        # the members refreshing from us download after our sync returned: count their answers in this round
        await self.sync.wait_served(r, report.downloaders, REFRESH_ACCOUNTING_WAIT_S)
        served = self.sync.refresh_bytes_served_in(r)
        self._served_counted += served
        bytes_sent = report.allreduce_bytes_sent + served
        self.stats.bytes_sent += bytes_sent
        total = sum(p.numel() for p in self.model.parameters())
        dp_bytes = int(steps * 2 * 4 * total)
        self.ctx.events.publish(RoundDone(
            self.outer_round, report.group_sizes.get("shared", 1), bytes_sent,
            report.allreduce_bytes_received + report.refresh_bytes_received, report.seconds, {}, 1,
            round(time.perf_counter() - started, 3), weight, steps, dp_bytes, self.digest(), ROLE, eval_loss,
            self.stats.tokens, **self._units))
        await self.ctx.status.publish()

    def snapshot_model(self) -> None:
        """The whole model as of the latest sync (fp32, flat), served to joining peers."""
        self._model_snapshot = StateSnapshot.from_tensors(
            {"model": torch.cat([p.detach().reshape(-1).float().cpu() for p in self.model.parameters()])},
            {"outer_round": self.outer_round})

    def digest(self) -> str:
        return hashlib.sha256(self.sync.shared.flatten(self.model).numpy().tobytes()).hexdigest()

    async def catch_up(self, view: dict[str, tuple[PeerClaim, int]]) -> None:
        """Adopt the whole model of the most advanced live peer if one is past our round."""
        ahead = sorted(((rr, p) for p, (_, rr) in view.items() if rr > self.outer_round), reverse=True)
        if not ahead:
            return
        total = sum(p.numel() for p in self.model.parameters())

        def validate(snapshot: StateSnapshot) -> tuple[torch.Tensor, int]:
            flat = snapshot.tensors({"model": (torch.float32, total)})["model"]
            outer_round = snapshot.metadata.get("outer_round")
            if not isinstance(outer_round, int) or isinstance(outer_round, bool) or outer_round < 0:
                raise ProtocolViolation(f"bad outer_round {outer_round!r}")
            return flat, outer_round

        got = await self.state_sync.download_first([p for _, p in ahead], 4 * total + 4096, validate)
        if got is None:
            return
        flat, outer_round = got.state
        offset = 0
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.outer_round = outer_round
        self._round_members = frozenset()  # we were in none of the rounds we skipped
        self.global_step = outer_round * self.cfg.sync_steps
        self.steps_since_sync = self.samples_since_sync = 0  # local steps of a resumed checkpoint are superseded
        self.ctx.events.publish(StateDownloaded(outer_round, got.peer, self.digest(), got.seconds,
                                                got.payload_bytes / 1e6, 0))

    # ----------------------------------------------------------------------------------------------------- checkpoint

    def save_checkpoint(self) -> None:
        """Model (every parameter, by name), this peer's AdamW state (by index among its trained parameters), its
        claim, outer round, step counters and sampler position."""
        tensors = {f"model.{name}": p.detach() for name, p in self.model.named_parameters()}
        tensors.update(optimizer_tensors(self.optimizer))
        metadata = {
            "run_id": self.ctx.run_id, "run_fingerprint": self.run_cfg.fingerprint(), "role": ROLE,
            "outer_round": self.outer_round, "global_step": self.global_step,
            "steps_since_sync": self.steps_since_sync, "samples_since_sync": self.samples_since_sync,
            "experts": sorted(self.own), "sampler": self.sampler.state_dict(), "tokens": self.stats.tokens,
            "rounds_ok": self.stats.rounds_ok,
        }
        self.ctx.checkpoints.save(Checkpoint(tensors, metadata))

    def _checkpoint_is_mine(self, metadata: dict) -> bool:
        return metadata.get("role") == ROLE

    def resume(self) -> None:
        """Continue from the local checkpoint if there is one. Raises :class:`peerd.worker.checkpoint_file.CheckpointError` if
        it was written under another configuration of the run or does not fit the model."""
        checkpoint = self.load_checkpoint()
        if checkpoint is None:
            return
        path = self.ctx.checkpoints.path
        meta, t = checkpoint.metadata, checkpoint.tensors
        try:
            experts = frozenset(int(e) for e in meta["experts"])
            if not all(0 <= e < self.n_experts for e in experts):
                raise ValueError(f"expert indices {sorted(experts)} out of range")
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(t[f"model.{name}"])
            self.set_own(experts)
            load_optimizer_tensors(self.optimizer, t, self.device)
            self.sampler.load_state_dict(meta["sampler"])
            self.outer_round, self.global_step = int(meta["outer_round"]), int(meta["global_step"])
            self.steps_since_sync = int(meta["steps_since_sync"])
            self.samples_since_sync = int(meta["samples_since_sync"])
            self.stats.tokens = int(meta.get("tokens", 0))
            self.stats.rounds_ok = int(meta.get("rounds_ok", 0))
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path} is incomplete or mismatched: {e}") from None
        if self.steps_since_sync == 0:  # the synced model of outer_round: serve it to joiners
            self.snapshot_model()
        self.ctx.events.publish(CheckpointResumed(self.outer_round, self.digest(), str(path), self.steps_since_sync))

    def status_fields(self) -> dict:
        tries = self.sync.tries.record(self.outer_round)
        return dict(super().status_fields(), experts=sorted(self.own),
                    **({RETRIES_FIELD: {self.sync.tries.fragment: tries}} if tries else {}))

    async def _retry_records(self) -> dict[str, dict]:
        """The other peers' status records, for the agreed try of the round (empty if the DHT did not answer: our
        own count of failed tries still moves us to a fresh key)."""
        try:
            records = await self.ctx.status.records()
        except (OSError, asyncio.TimeoutError) as e:
            logger.info("could not read status records: %s", e)
            return {}
        return {p: r for p, r in records.items() if p != self.peer_id}
