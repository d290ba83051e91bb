"""SWARM details: the mean gradient over ``step_every`` micro-batches, compute in a worker thread, ``--stage``
checked against the run, the stage-move event and per-stage metrics."""

import asyncio
import copy

import pytest
import torch

from peerd.config import ConfigError, NodeConfig
from peerd.events import StageMoved, StageRoundDone, SwarmProgress
from peerd.models import build_model, split_model
from peerd.roles.base import RunContext
from peerd.roles.swarm import SwarmRole
from peerd.run_config import RunConfig
from peerd.service.metrics import Metrics
from peerd.transport.inprocess import Hub
from protocols.stage_service import PipelineTrainer, StageService
from protocols.swarm import SwarmConfig, Wiring

pytestmark = pytest.mark.timeout(120)

SEQ_LEN = 16


def service_name(k: int) -> str:
    return f"run.swarm.stage{k}"


def batch(seed: int, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, SEQ_LEN), generator=g), torch.randint(0, 256, (b, SEQ_LEN), generator=g)


async def _train(stages, step_every: int, batches, compute_thread: bool = False):
    """One server per stage with SGD (lr 1), ``step_every``; the trainer pushes ``batches``; returns the stages."""
    config = SwarmConfig(codec="none")
    hub = Hub()
    services = []
    for k, stage in enumerate(stages):
        optimizer = torch.optim.SGD(stage.parameters(), lr=1.0)
        service = StageService(service_name(k), stage, config, optimizer=optimizer, step_every=step_every,
                               compute_thread=compute_thread)
        await service.start(hub.transport(f"s{k}"))
        services.append(service)
    wiring = Wiring(len(stages))
    wiring.set_servers({k: [f"s{k}"] for k in range(len(stages))})
    trainer = PipelineTrainer(hub.transport("t").streams, service_name, wiring, config, d_model=128)
    losses = [await trainer.step(*b) for b in batches]
    for service in services:
        await service.stop()
    return services, losses


def test_step_every_steps_on_the_mean_gradient_of_its_micro_batches():
    """Two different micro-batches with step_every=2 move the parameters exactly like one step on their mean
    gradient (the sum would move them twice as far)."""
    stages = split_model(build_model("tiny", seq_len=SEQ_LEN, seed=0), 2)
    start = copy.deepcopy(stages)
    services, _ = asyncio.run(_train(stages, 2, [batch(1), batch(2)]))
    assert all(s.steps == 1 for s in services)
    grads = []
    for b in (batch(1), batch(2)):  # the reference: each micro-batch's gradient on the start parameters
        ref = copy.deepcopy(start)
        x, y = b
        ref[1](ref[0](x), y).backward()
        grads.append([p.grad.clone() for stage in ref for p in stage.parameters()])
    expected = [p.detach() - (g1 + g2) / 2
                for p, g1, g2 in zip((p for stage in start for p in stage.parameters()), *grads)]
    got = [p.detach() for stage in stages for p in stage.parameters()]
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_compute_in_a_worker_thread_gives_the_same_training():
    batches = [batch(i) for i in range(3)]
    on_loop = split_model(build_model("tiny", seq_len=SEQ_LEN, seed=0), 2)
    threaded = copy.deepcopy(on_loop)
    _, losses_loop = asyncio.run(_train(on_loop, 1, batches))
    services, losses_thread = asyncio.run(_train(threaded, 1, batches, compute_thread=True))
    assert losses_loop == losses_thread and services[0].steps == 3
    for a, b in zip(on_loop, threaded):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)


def test_a_stage_beyond_the_runs_stages_is_a_config_error(tmp_path):
    run = RunConfig(model="tiny", seq_len=64, parallelism="swarm", swarm=SwarmConfig(stages=2))
    assert run.stage_error(1) is None
    assert run.stage_error(2) == "--stage 2: the run has stages 0-1"
    assert "no stages" in RunConfig(model="tiny", seq_len=64).stage_error(0)
    node = NodeConfig(checkpoint_dir=str(tmp_path), device="cpu", stage=5)
    ctx = RunContext.build("swarmunit", run, node, Hub().transport("p"), stop=asyncio.Event())
    with pytest.raises(ConfigError, match="stages 0-1"):  # the CLI turns ConfigError into one line and exit 2
        SwarmRole(ctx)


def test_stage_metrics_follow_the_swarm_events():
    metrics = Metrics()
    for event in (StageRoundDone(1, 3, 2, 1000, 900, 16.0, "ab"), StageRoundDone(1, 4, 2, 500, 400, 8.0, "cd"),
                  StageMoved(0, 1, "peerX", 4, 20.0, 9.5), SwarmProgress(10, 3.2, 12, 10, 3, 2)):
        metrics.observe(event)
    value = metrics.registry.get_sample_value
    assert value("peerd_stage_rounds_total", {"stage": "1"}) == 2
    assert value("peerd_stage_round_bytes_total", {"stage": "1"}) == 1500
    assert value("peerd_stage_moves_total", {"from_stage": "0", "to_stage": "1"}) == 1
    assert value("peerd_stage") == 1
    assert value("peerd_swarm_micro_batches", {"outcome": "dropped"}) == 2
    assert value("peerd_swarm_micro_batches", {"outcome": "sent"}) == 12
    assert StageMoved(0, 1, "", 0, None, None).message().endswith("the initial weights")


def test_a_trainer_calls_its_own_stage_in_process():
    """The trainer is the only server of stage 0: its calls to that stage never dial (its service is not even
    reachable on the hub here) and the micro-batch trains both stages."""
    async def main():
        stages = split_model(build_model("tiny", seq_len=SEQ_LEN, seed=0), 2)
        config = SwarmConfig(codec="none")
        hub = Hub()
        own = StageService(service_name(0), stages[0], config,
                           optimizer=torch.optim.SGD(stages[0].parameters(), lr=0.1), compute_thread=True)
        last = StageService(service_name(1), stages[1], config,
                            optimizer=torch.optim.SGD(stages[1].parameters(), lr=0.1))
        await last.start(hub.transport("s1"))
        wiring = Wiring(2)
        wiring.set_servers({0: ["me"], 1: ["s1"]})
        trainer = PipelineTrainer(hub.transport("me").streams, service_name, wiring, config, d_model=128,
                                  local_stage=lambda k: own if k == 0 else None)
        losses = [await trainer.step(*batch(i)) for i in range(2)]
        await own.stop()
        return own, last, wiring, losses

    own, last, wiring, losses = asyncio.run(main())
    assert all(loss is not None for loss in losses) and wiring.stats.failures_by_server == {}
    assert own.steps == 2 and last.steps == 2 and own.pending == 0
