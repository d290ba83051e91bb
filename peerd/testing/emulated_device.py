"""An emulated accelerator for benchmarks and tests: the DiLoCo worker's inner step takes a GPU's measured step time
and applies a cheap deterministic update to the model's real parameters, so a machine without a GPU runs real
daemons whose compute and links stand in a GPU's ratio, and a real, full-sized pseudo-gradient crosses the network.

The default step time is measured, not guessed: docs/benchmarks.md, section "GPU use: a peer's inner steps vs a
plain PyTorch loop" (``scripts/bench_gpu.py --device cuda --presets 125m 1.1b``, one NVIDIA H200, 2026-11-26): the
1.1b preset trains at 53,476 tok/s through peerd's inner step on batches of 16 x 1,024 tokens, so one inner step
takes 16,384 / 53,476 = 0.306 s (:data:`GPU_STEP_S`).

Each emulated step (:class:`EmulatedStep`) multiplies one slice of the parameters (1/``slices`` of them, the next
slice each step, in parameter order) by ``1 - decay``, then sleeps until ``step_s`` has passed since the step began
(a step whose update outlasts ``step_s`` does not sleep and is counted in ``overruns``). theta_local after n steps
is therefore a pure function of theta at the start and n: every peer that starts from the same state holds the same
theta_local, and the pseudo-gradient theta_outer - theta_local is a real vector of the model's size with the
weights' spread of values (what a codec meets), not zeros. The returned "loss" is the updated slice's mean |theta|.

Production code never imports this module. A daemon gets it only through the context hook
(:data:`peerd.roles.base.CONTEXT_HOOK_ENV`), which replaces the role context's ``wrap_inner_step``:
:meth:`EmulatedDevice.environ` gives the environment variables (with a fault schedule of :mod:`peerd.testing.faults`
in the environment, that is applied too).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

#: Environment variable holding the emulated device's settings (:meth:`EmulatedDevice.to_json`).
ENV = "PEERD_EMULATED_DEVICE"

#: The 1.1b preset's inner-step throughput through peerd on one H200, tokens per second (docs/benchmarks.md, "GPU use:
#: a peer's inner steps vs a plain PyTorch loop", 2026-11-26).
H200_TOKENS_PER_S_1P1B = 53_476
#: Tokens per inner step in that measurement: batch 16 x seq_len 1,024.
GPU_BATCH_TOKENS = 16 * 1024
#: Seconds per inner step of the 1.1b preset on that GPU: 16,384 / 53,476 = 0.306 s.
GPU_STEP_S = GPU_BATCH_TOKENS / H200_TOKENS_PER_S_1P1B


@dataclasses.dataclass(frozen=True)
class EmulatedDevice:
    """How an emulated inner step behaves. ``step_s``: seconds per step (> 0); ``slices``: the update touches
    1/``slices`` of the parameters per step (>= 1); ``decay``: the update's factor is ``1 - decay`` (0 < decay < 1).
    Raises ValueError otherwise."""

    step_s: float = GPU_STEP_S
    slices: int = 64
    decay: float = 1e-3

    def __post_init__(self) -> None:
        if not self.step_s > 0:
            raise ValueError(f"step_s must be > 0, got {self.step_s!r}")
        if self.slices < 1:
            raise ValueError(f"slices must be >= 1, got {self.slices!r}")
        if not 0 < self.decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {self.decay!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "EmulatedDevice":
        """Raises ValueError for text that is no JSON object of this class's fields (or holds bad values)."""
        try:
            return cls(**json.loads(text))
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{ENV} is not a valid emulated device: {e}") from None

    def environ(self) -> dict[str, str]:
        """Environment variables that make a ``peerd join`` process train on this emulated device."""
        from peerd.roles.base import CONTEXT_HOOK_ENV

        return {ENV: self.to_json(), CONTEXT_HOOK_ENV: f"{__name__}:{install_from_env.__name__}"}


class EmulatedStep:
    """An inner step (``step(x, y) -> loss``, the interface of :class:`peerd.inner_step.InnerStep`) that updates
    ``model``'s parameters deterministically and takes ``device.step_s`` by ``clock`` (seconds), sleeping with
    ``sleep``. ``steps``: steps taken (the next step updates slice ``steps % slices``); ``overruns``: steps whose
    update alone outlasted ``step_s``. ``x`` and ``y`` are ignored."""

    def __init__(self, model: torch.nn.Module, device: EmulatedDevice, *, steps: int = 0,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        self.model = model
        self.device = device
        self.steps = steps
        self.overruns = 0
        self.clock, self.sleep = clock, sleep
        params = [p for p in model.parameters()]
        self._params = params
        self._total = sum(p.numel() for p in params)
        if self._total == 0:
            raise ValueError("the model has no parameters to update")

    def slice_bounds(self, k: int) -> tuple[int, int]:
        """[start, end) of slice ``k`` (0 <= k < slices) in the parameters' concatenation (parameter order)."""
        n = self.device.slices
        return self._total * k // n, self._total * (k + 1) // n

    @torch.no_grad()
    def update(self, k: int) -> torch.Tensor:
        """Multiply slice ``k`` of the parameters by ``1 - decay``; returns its mean |theta| (0-d fp32)."""
        start, end = self.slice_bounds(k)
        offset, total, count = 0, torch.zeros((), dtype=torch.float32), 0
        for p in self._params:
            lo, hi = max(start, offset), min(end, offset + p.numel())
            if lo < hi:
                piece = p.view(-1)[lo - offset:hi - offset]
                piece.mul_(1.0 - self.device.decay)
                total += piece.abs().sum().float()
                count += hi - lo
            offset += p.numel()
            if offset >= end:
                break
        return total / max(count, 1)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        began = self.clock()
        loss = self.update(self.steps % self.device.slices)
        self.steps += 1
        left = began + self.device.step_s - self.clock()
        if left > 0:
            self.sleep(left)
        else:
            self.overruns += 1
            logger.warning("emulated step %d: the update took %.3f s, longer than the step's %.3f s",
                           self.steps, self.device.step_s - left, self.device.step_s)
        return loss


def install(ctx, device: EmulatedDevice):
    """``ctx`` (a :class:`peerd.roles.base.RunContext`) whose inner steps are ``device``'s: the worker's inner step
    (anything with a ``model`` attribute, e.g. :class:`peerd.inner_step.InnerStep`) is replaced by an
    :class:`EmulatedStep` over the same model. A step built later (a fresh inner optimizer) goes on counting from
    where the last one stopped."""
    last: list[Optional[EmulatedStep]] = [None]

    def wrap(step):
        emulated = EmulatedStep(step.model, device, steps=last[0].steps if last[0] is not None else 0)
        last[0] = emulated
        return emulated

    return dataclasses.replace(ctx, wrap_inner_step=wrap)


def install_from_env(ctx):
    """The context hook: :func:`install` with the settings of :data:`ENV` (unset: ``ctx`` unchanged), after the
    fault schedule of ``PEERD_FAULTS`` if one is set (:func:`peerd.testing.faults.instrument_from_env`)."""
    from peerd.testing.faults import instrument_from_env

    ctx = instrument_from_env(ctx)
    text = os.environ.get(ENV)
    return install(ctx, EmulatedDevice.from_json(text)) if text else ctx
