"""The DiLoCo worker's inner loop: how this machine computes an inner step, and the steps up to a round boundary.

The inner step (:class:`peerd.worker.inner_step.InnerStep`) runs AdamW on a fresh batch with the run's warm-up/cosine
learning rate at the worker's global step; micro-batches, precision, ``torch.compile`` and activation checkpointing
come from the node config, several local devices train as one peer (:mod:`peerd.worker.local_dp`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from peerd.config import ConfigError
from peerd.events import InnerProgress
from peerd.worker.inner_step import InnerStep, make_optimizer
from protocols.diloco import inner_lr_at, set_lr

logger = logging.getLogger(__name__)


class InnerLoop:
    """Part of :class:`peerd.worker.outer_worker.OuterWorker`: its inner optimizer, inner step and
    :meth:`train_until_quota`."""

    def _setup_inner_step(self, node) -> None:
        """How this machine computes the run's inner step: micro-batches, precision, compile, checkpointing."""
        self._check_inner_step()
        if node.activation_checkpointing:
            if hasattr(self.model, "activation_checkpointing"):
                self.model.activation_checkpointing = True
            else:  # a node preset may ask for it whatever the run's model: train without it
                logger.warning("activation_checkpointing: model %r does not support it; training without it",
                               self.run_cfg.model)
        self.local_dp = None
        if len(node.local_devices) > 1:  # several devices, one peer: the helpers compile their own replicas
            from peerd.worker.local_dp import LocalDataParallel, LocalDevicesError, replica_spec

            try:
                self.local_dp = LocalDataParallel(self.model, node.local_devices,
                                                  replica_spec(self.run_cfg, node, self.ctx.tokenizer.vocab_size,
                                                               self.precision))
            except LocalDevicesError as e:
                raise ConfigError(str(e), key="local_devices", reason=str(e)) from None
            logger.info("training on %d local devices as one peer: %s", len(node.local_devices),
                        ", ".join(node.local_devices))
        # The compiled module shares the parameters; everything else (flatten, checkpoints) uses self.model.
        self._forward = torch.compile(self.model) if node.compile and self.local_dp is None else self.model
        self._warmup_steps = 1 if node.compile else 0  # the first call compiles: not counted in tokens/s
        self.new_optimizer()

    def new_optimizer(self) -> None:
        """A fresh inner optimizer (and the step that drives it)."""
        self.optimizer = make_optimizer(self.model.parameters(), torch.device(self.device).type, hp=self.hp,
                                        eight_bit=self.ctx.node.optimizer_8bit)
        if self.local_dp is not None:
            self.inner_step = self.ctx.wrap_inner_step(self.local_dp.inner_step(self.optimizer, self.precision))
            return
        self.inner_step = self.ctx.wrap_inner_step(InnerStep(
            self.model, self.optimizer, batch_size=self.run_cfg.batch_size,
            micro_batch_size=self.ctx.node.micro_batch_size, precision=self.precision,
            grad_clip_norm=self.hp.grad_clip_norm, forward=self._forward))

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

    async def train_until_quota(self) -> None:
        """Inner steps until ``round_quota`` steps since the last sync, a stop or a pause (or, with the delayed
        overlap, the run's last round landing between two steps). Publishes :class:`peerd.events.InnerProgress`
        every ``log_every_steps`` steps and at the quota."""
        loop = asyncio.get_running_loop()
        tokens_per_step = self.run_cfg.batch_size * self.run_cfg.seq_len
        window_start, window_steps = time.perf_counter(), 0
        while (self.steps_since_sync < self.round_quota and not self.ctx.stop.is_set()
               and not self.ctx.gate.paused):
            if not await self.sampler.ready():  # a sharded run's next shard not fetched yet, and stopped meanwhile
                break
            loss_on_device = await loop.run_in_executor(None, self._inner_step)
            self.steps_since_sync += 1
            self.samples_since_sync += self.run_cfg.batch_size
            self.steps_total += 1
            self.samples_total += self.run_cfg.batch_size
            self.stats.tokens += tokens_per_step
            if await self.rounds.between_steps():
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
