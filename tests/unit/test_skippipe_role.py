"""SkipPipe training in-process: the SWARM role with ``skip_ratio = 0.25`` on 4 stages (1-2 servers each); the
held-out loss falls, paths skip stages, and the loss of a middle stage's only server mid-run does not stop
training (its stage is skipped from then on)."""

import asyncio
import dataclasses

import pytest

from peerd.config import NodeConfig
from peerd.data.corpus import load_corpus
from peerd.roles.base import RunContext
from peerd.roles.swarm import SwarmRole, stage_service_name
from peerd.run_config import RunConfig
from peerd.commands.swarm_infer import evaluate_swarm
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams
from protocols.stage_service import PipelineTrainer
from protocols.swarm import SwarmConfig, Wiring

pytestmark = pytest.mark.timeout(150)

STEPS = 30
KILL_AT = 12
SEQ_LEN = 64


def _run() -> RunConfig:
    return RunConfig(model="tiny", seq_len=SEQ_LEN, batch_size=8, eval_batches=0, parallelism="swarm",
                     swarm=SwarmConfig(stages=4, skip_ratio=0.25, call_timeout_s=10.0, pending_timeout_s=30.0,
                                       sync_interval_s=0, ban_s=60.0),
                     diloco=DiLoCoHyperparams(inner_lr=3e-3, inner_weight_decay=0.0))


def test_skip_ratio_is_validated_and_fingerprint_neutral_at_zero():
    base = RunConfig(model="tiny", parallelism="swarm", swarm=SwarmConfig(stages=4))
    assert dataclasses.replace(base, swarm=SwarmConfig(stages=4, skip_ratio=0.0)).fingerprint() == base.fingerprint()
    assert dataclasses.replace(base, swarm=SwarmConfig(stages=4, skip_ratio=0.25)).fingerprint() != base.fingerprint()
    for bad in (-0.1, 1.0, True, "0.5"):
        with pytest.raises(ValueError):
            SwarmConfig(skip_ratio=bad)
    assert RunConfig.from_dict({"model": "tiny", "parallelism": "swarm",
                                "swarm": {"stages": 4, "skip_ratio": 0.25}}).swarm.skip_ratio == 0.25


def test_skippipe_trains_and_survives_losing_a_middle_stage(tmp_path):
    async def main():
        hub, stop = Hub(), asyncio.Event()
        run = _run()
        roles, tasks = [], []

        async def start(i, stage):
            node = NodeConfig(checkpoint_dir=str(tmp_path / f"p{i}"), threads=1, device="cpu",
                              status_interval_s=0.5, status_ttl_s=5.0)
            ctx = RunContext.build("skipunit", run, node, hub.transport(f"p{i}"), stop=stop)
            role = SwarmRole(ctx, stage=stage, trainer=i == 5, max_steps=STEPS)
            roles.append(role)
            tasks.append(asyncio.ensure_future(role.run(ctx)))
            while role.service is None:
                await asyncio.sleep(0.01)
            await role.announce()

        # stage 0: p0 and the trainer p5 (which stops serving when it is done); stage 1 has two servers, stage 2
        # one (killed mid-run), stage 3 one
        for i, stage in enumerate([0, 1, 1, 2, 3]):
            await start(i, stage)
        reader = PipelineTrainer(hub.transport("reader").streams, lambda k: stage_service_name(roles[0].ctx, k),
                                 Wiring(4), run.swarm, d_model=128)
        reader.wiring.set_servers({0: ["p0"], 1: ["p1"], 2: ["p3"], 3: ["p4"]})
        eval_tokens = load_corpus("shakespeare").eval
        before = await evaluate_swarm(reader, eval_tokens, SEQ_LEN, 8, 2)
        await start(5, 0)
        trainer = roles[5]
        while len(trainer.losses) < KILL_AT:
            assert not tasks[5].done(), tasks[5]
            await asyncio.sleep(0.05)
        tasks[3].cancel()  # stage 2's only server dies
        hub.disconnect("p3")
        await asyncio.wait_for(tasks[5], 120)
        after = await evaluate_swarm(reader, eval_tokens, SEQ_LEN, 8, 2)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        return roles, before, after

    roles, before, after = asyncio.run(main())
    trainer = roles[5]
    stats = trainer.wiring.stats
    assert len(trainer.losses) == STEPS and stats.completed == STEPS, stats
    assert stats.dropped <= 1  # at most the micro-batch that met the dead server
    paths = trainer.paths
    assert all(p[0] == 0 and p[-1] == 3 and len(p) == 3 for p in paths), paths  # one of 4 stages skipped
    early = paths[:KILL_AT]
    assert any(1 not in p for p in early) and any(2 not in p for p in early)
    assert all(2 not in p for p in paths[-STEPS // 4:])  # after the kill, stage 2 is skipped
    # both servers of stage 1 took micro-batches; the held-out loss fell (evaluated through the stages left)
    assert min(roles[1].service.backwards, roles[2].service.backwards) >= 3
    assert before.skipped == () and after.skipped == (2,)
    assert after.nats_per_byte < before.nats_per_byte - 0.5, (before, after)
