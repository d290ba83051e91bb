"""Does a swarm train like one process? An in-process swarm and the same model in one process, on the same tokens.

:func:`swarm_losses` runs SWARM's real code in one process: a :class:`peerd.roles.swarm.SwarmRole` per stage server
(``replicas`` per stage, on a :class:`peerd.transport.inprocess.Hub`), a :class:`PipelineTrainer` pushing the
micro-batches through them, and every ``round_every`` micro-batches a stage round of every server (``sync_once``:
the run's outer-sync strategy, matchmaking and all-reduce included). Rounds come on a count of micro-batches, a
virtual clock, so a run is deterministic in what it computes: the micro-batch order, the server each micro-batch
goes to (drawn from a seeded generator) and the rounds do not depend on the machine's speed.

:func:`single_process_losses` trains the same stages (the same split, initial weights and inner AdamW) in one
process on the same micro-batches: the reference a swarm must match (:func:`convergence`).

Used by ``tests/unit/test_swarm_convergence.py`` and ``scripts/bench_swarm.py`` (its convergence row).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from peerd.config import NodeConfig
from peerd.models import build_model, split_model
from peerd.roles.base import RunContext
from peerd.roles.outer_sync import RoundResult
from peerd.roles.swarm import SwarmRole, stage_service_name
from peerd.run_config import RunConfig
from peerd.transport.inprocess import Hub
from protocols.stage_service import PipelineTrainer
from protocols.swarm import Wiring

__all__ = [
    "Convergence", "all_rounds_completed", "convergence", "micro_batches", "single_process_losses", "swarm_losses",
]


def micro_batches(run: RunConfig, count: int, seed: str = "convergence") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` Shakespeare micro-batches of the run's shape: (tokens, targets), each int64 (B, T)."""
    from peerd.data.corpus import WindowSampler, load_corpus

    sampler = WindowSampler(load_corpus(run.dataset).train, run.seq_len, run.batch_size, seed=seed)
    return [tuple(t.long() for t in sampler.next_batch()) for _ in range(count)]


def _inner_optimizer(module: torch.nn.Module, run: RunConfig) -> torch.optim.AdamW:
    hp = run.diloco  # the stage servers' optimizer (peerd.roles.swarm.SwarmRole._build_service)
    return torch.optim.AdamW(module.parameters(), lr=hp.inner_lr, betas=hp.inner_betas,
                             weight_decay=hp.inner_weight_decay)


def single_process_losses(run: RunConfig, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Train the run's ``[swarm] stages`` stages in this process, one AdamW step of every stage per micro-batch
    (as a swarm with one server per stage and no rounds); returns the loss of each micro-batch (nats per token)."""
    stages = split_model(build_model(run.model, seq_len=run.seq_len, seed=run.seed), run.swarm.stages)
    optimizers = [_inner_optimizer(stage, run) for stage in stages]
    losses = []
    for tokens, targets in batches:
        x = tokens
        for stage in stages[:-1]:
            x = stage(x)
        loss = stages[-1](x, targets)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


async def swarm_losses(run: RunConfig, batches: list[tuple[torch.Tensor, torch.Tensor]], replicas: int,
                       round_every: int, *, seed: int = 0, kill: Optional[tuple[int, int, int]] = None,
                       on_round: Optional[Callable[[list], None]] = None) -> list[float]:
    """Push ``batches`` through an in-process swarm of ``replicas`` servers per stage (see the module docstring);
    returns the loss of each micro-batch.

    Args:
        run: a SWARM run config; its ``[swarm] sync_interval_s`` should be 0 (rounds come from here).
        round_every: a stage round of every live server after every this many micro-batches (0: never).
        seed: draws the server of each stage for each micro-batch.
        kill: ``(micro-batch, stage, replica)``: that server dies (its transport disconnects, its role is
            cancelled) before that micro-batch; the trainer's retries and the remaining replicas carry on.
        on_round: called with the outcomes of every round (e.g. to count or check them).

    Raises:
        RuntimeError: a micro-batch was dropped (no server of a stage answered).
    """
    hub, stop = Hub(), asyncio.Event()
    rng = random.Random(seed)
    names = {k: [f"s{k}r{j}" for j in range(replicas)] for k in range(run.swarm.stages)}
    roles: dict[str, SwarmRole] = {}
    tasks = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, stage_names in names.items():
            for name in stage_names:
                node = NodeConfig(checkpoint_dir=f"{tmp}/{name}", threads=1, device="cpu", status_interval_s=0.5,
                                  status_ttl_s=30.0)
                ctx = RunContext.build("convergence", run, node, hub.transport(name), stop=stop)
                role = SwarmRole(ctx, stage=k, trainer=False)
                roles[name] = role
                tasks.append(asyncio.ensure_future(role.run(ctx)))
                while role.service is None:
                    await asyncio.sleep(0.01)
                await role.announce()
        any_ctx = next(iter(roles.values())).ctx
        wiring = Wiring(run.swarm.stages, ban_s=3600.0)
        wiring.set_servers(names)
        trainer = PipelineTrainer(hub.transport("trainer").streams, lambda k: stage_service_name(any_ctx, k), wiring,
                                  run.swarm, d_model=run_d_model(run))
        live = dict(roles)
        losses: list[float] = []
        try:
            for i, (tokens, targets) in enumerate(batches):
                if kill is not None and i == kill[0]:  # a crash: no goodbye, its records expire on their own
                    victim = names[kill[1]][kill[2]]
                    hub.disconnect(victim)
                    live.pop(victim)
                    tasks[list(roles).index(victim)].cancel()
                prefer = {k: rng.choice(stage_names) for k, stage_names in names.items()}
                loss = await trainer.step(tokens, targets, prefer=prefer)
                if loss is None:
                    raise RuntimeError(f"micro-batch {i} was dropped: {wiring.stats}")
                losses.append(loss)
                if round_every and (i + 1) % round_every == 0:
                    outcomes = await asyncio.wait_for(asyncio.gather(*(r.sync_once() for r in live.values())), 120)
                    if on_round is not None:
                        on_round(outcomes)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    return losses


def run_d_model(run: RunConfig) -> int:
    """Width of the activations between the run's stages."""
    return build_model(run.model, seq_len=run.seq_len, seed=run.seed).config.d_model


@dataclass(frozen=True)
class Convergence:
    """A swarm's loss curve against the single process's, on the same micro-batches.

    ``last``: mean loss of the last ``tail`` micro-batches (swarm, single process); ``ratio``: swarm / single;
    ``max_rise``: the largest rise of the swarm's loss (mean over a window of ``window`` micro-batches) above its
    running minimum, as a fraction (0.1: 10% above the lowest window so far)."""

    last: tuple[float, float]
    ratio: float
    max_rise: float


def convergence(swarm: list[float], single: list[float], tail: int = 100, window: int = 50) -> Convergence:
    """Compare two loss curves of equal length (see :class:`Convergence`). Raises ValueError if they differ in
    length or are shorter than ``tail`` and ``window``."""
    if len(swarm) != len(single) or len(swarm) < max(tail, window):
        raise ValueError(f"curves of {len(swarm)} and {len(single)} losses (need equal, >= {max(tail, window)})")
    last = (statistics.mean(swarm[-tail:]), statistics.mean(single[-tail:]))
    lowest, rise = float("inf"), 0.0
    for end in range(window, len(swarm) + 1):
        smoothed = statistics.mean(swarm[end - window:end])
        lowest = min(lowest, smoothed)
        rise = max(rise, smoothed / lowest - 1)
    return Convergence(last, last[0] / last[1], rise)


def all_rounds_completed(outcomes: list) -> bool:
    """Whether every outcome of a stage round is a completed round."""
    return all(isinstance(o, RoundResult) for o in outcomes)
