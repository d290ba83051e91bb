"""The DiLoCo worker's evaluation after an outer round.

The model evaluated is theta_outer (the same on every peer). Where theta_local is not theta_outer after a round
(Streaming fragments: the fragments synced earlier in the cycle have trained on; the delayed overlap: theta_local
never restarts from theta_outer), theta_outer is put together in a copy of the model and evaluated there; so it is
with the node's ``background_eval`` (by default where a GPU trains), which evaluates the copy while training goes
on and publishes an ``eval`` event when done.
"""

from __future__ import annotations

import asyncio
from typing import Optional

import torch

from peerd.events import Evaluated
from peerd.hardware.devices import off_the_round
from peerd.models import build_model
from peerd.runtime.processes import reap
from peerd.roles.base import held_out_loss


class RoundEvaluation:
    """Part of :class:`peerd.worker.outer_worker.OuterWorker`: :meth:`round_eval`."""

    _eval_task: Optional[asyncio.Task] = None  # background_eval: the evaluation running now
    _eval_model: Optional[torch.nn.Module] = None  # the copy evaluated

    async def round_eval(self) -> Optional[float]:
        """The evaluation after an outer round: every ``eval_every`` rounds and after the last one; in the background
        with the node's ``background_eval`` (then None here: an ``eval`` event follows)."""
        if self.outer.outer_round % self.run_cfg.eval_every and not self.finished():
            return None
        background = off_the_round(self.ctx.node.background_eval, torch.device(self.device))
        if not self.run_cfg.eval_batches or not (self.rounds.local_differs or background):
            return await self.evaluate()
        if self._eval_task is not None:  # one at a time: the copy below is shared
            await reap(self._eval_task, cancel=False)  # a failed background evaluation is logged there
        if self._eval_model is None:
            self._eval_model = build_model(self.run_cfg.model, self.run_cfg.seq_len, self.run_cfg.seed,
                                           self.ctx.tokenizer.vocab_size).to(self.device)
        # No inner step runs now: the parameters copied hold still.
        with torch.no_grad():
            for mine, theirs in zip(self._eval_model.parameters(), self.model.parameters()):
                mine.copy_(theirs)
        for part in self.parts:
            part.fragment.load_(self._eval_model, part.outer.theta)
        task = asyncio.ensure_future(self._evaluate_copy(self.outer.outer_round, self.stats.tokens))
        if not background:
            return await task
        self._eval_task = task
        return None

    async def _evaluate_copy(self, outer_round: int, tokens: int) -> Optional[float]:
        """Held-out loss of the evaluation copy; in the background it is published as an ``eval`` event."""
        loss = await held_out_loss(self._eval_model, self.eval_tokens, self.run_cfg)
        if loss is not None:
            self.stats.last_eval = loss
        if off_the_round(self.ctx.node.background_eval, torch.device(self.device)):
            self.ctx.events.publish(Evaluated(outer_round, loss, tokens, **self._units))
        return loss

    async def wait_for_evaluation(self) -> bool:
        """Wait until the background evaluation running now is done (a failed one is logged); False where none
        runs (``background_eval`` off, or already done and waited for)."""
        task, self._eval_task = self._eval_task, None
        if task is None:
            return False
        await reap(task, cancel=False)
        return True

    async def _finish_background(self) -> None:
        if self._eval_task is not None:
            await reap(self._eval_task, cancel=False)  # leaving: a failed one is logged, and the exit goes on

