"""Reliability row B9: a stage server that returns noised (finite) activations is caught by the trainer's
spot-checks and banned; honest replicas are not."""

import asyncio
import copy
import random

import pytest
import torch

from peerd.models import build_model, split_model
from peerd.transport.inprocess import Hub
from protocols.stage_service import PipelineTrainer, StageService, outputs_agree
from protocols.swarm import SwarmConfig, Wiring

pytestmark = pytest.mark.timeout(120)

SEQ_LEN = 32
STEPS = 4


def service_name(k: int) -> str:
    return f"run.swarm.stage{k}"


def batch(seed: int, b: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, SEQ_LEN), generator=g), torch.randint(0, 256, (b, SEQ_LEN), generator=g)


class NoisedService(StageService):
    """A lying server: finite activations with noise of half their scale added (no finite check can see it)."""

    def _encode(self, x):
        return super()._encode(x + 0.5 * x.std() * torch.randn_like(x))


class LossLiar(StageService):
    """A lying last stage: reports twice the loss it computed."""

    async def rpc_loss(self, request):
        header, payload = await super().rpc_loss(request)
        return {**header, "loss": 2.0 * header["loss"]}, payload


async def _swarm(stage0: dict, stage1: dict, config: SwarmConfig, *, trainer_serves: str = ""):
    """Servers ``{name: class}`` per stage (every one starts from the same split model); a trainer whose
    ``local_stage`` is the service named ``trainer_serves`` (if any)."""
    stages = split_model(build_model("tiny", seq_len=SEQ_LEN, seed=0), 2)
    hub, services = Hub(), {}
    for k, names in enumerate((stage0, stage1)):
        for name, cls in names.items():
            services[name] = cls(service_name(k), copy.deepcopy(stages[k]), config)
            await services[name].start(hub.transport(name))
    wiring = Wiring(2, ban_s=600.0)
    wiring.set_servers({0: list(stage0), 1: list(stage1)})
    own = services.get(trainer_serves)
    trainer = PipelineTrainer(hub.transport(trainer_serves or "trainer").streams, service_name, wiring, config,
                              d_model=128, rng=random.Random(0),
                              local_stage=lambda k: own if own is not None and own.stage.index == k else None)
    return services, wiring, trainer


def test_noised_activations_are_outvoted_by_two_replicas_and_banned():
    async def main():
        config = SwarmConfig(codec="fp16", spot_check_prob=1.0)
        services, wiring, trainer = await _swarm({"evil": NoisedService, "a": StageService, "b": StageService},
                                                 {"last": StageService}, config)
        losses = [await trainer.step(*batch(i)) for i in range(STEPS)]
        return services, wiring, losses

    services, wiring, losses = asyncio.run(main())
    stats = wiring.stats
    assert wiring.stages[0].bans.is_banned("evil")
    assert stats.failures_by_server == {"evil": 1}, stats  # honest replicas agree with each other: never banned
    assert stats.spot_check_bans == 1 and stats.spot_check_unresolved == 0, stats
    assert stats.spot_checks >= STEPS, stats  # every stage call of every micro-batch checked
    # the micro-batch the liar served was retried on an honest replica: nothing dropped
    assert stats.completed == stats.sent == STEPS and stats.dropped == 0 and all(x is not None for x in losses)
    assert services["evil"].backwards == 0


def test_the_trainers_own_copy_referees_two_replicas():
    async def main():
        config = SwarmConfig(codec="fp16", spot_check_prob=1.0)
        services, wiring, trainer = await _swarm({"me": StageService, "evil": NoisedService},
                                                 {"last": StageService}, config, trainer_serves="me")
        # the trainer never dials itself (libp2p refuses a dial to self): its stage's other server is checked
        wiring.set_servers({0: ["evil"], 1: ["last"]})
        first = await trainer.step(*batch(0))
        return wiring, first

    wiring, first = asyncio.run(main())
    assert first is None  # the only other stage-0 server lied: the micro-batch had nowhere left to go (counted)
    assert wiring.stages[0].bans.is_banned("evil")
    assert wiring.stats.spot_check_bans == 1 and wiring.stats.dropped == 1


def test_two_replicas_that_disagree_are_unresolved_and_a_lying_last_stage_is_outvoted():
    async def main():
        config = SwarmConfig(codec="fp16", spot_check_prob=1.0)
        services, wiring, trainer = await _swarm({"evil": NoisedService, "a": StageService},
                                                 {"liar": LossLiar, "l1": StageService, "l2": StageService}, config)
        wiring.set_servers({0: ["evil"]})  # checks of "evil" need another stage-0 replica: "a" only
        wiring.stages[0].set_servers(["evil", "a"])
        losses = [await trainer.step(*batch(i)) for i in range(STEPS)]
        return wiring, losses

    wiring, losses = asyncio.run(main())
    stats = wiring.stats
    # stage 0: "evil" and "a" disagree, nobody can tell who lies: neither is banned
    assert stats.spot_check_unresolved >= 1
    assert not wiring.stages[0].bans.is_banned("evil") and not wiring.stages[0].bans.is_banned("a")
    # stage 1: the liar's loss disagrees with two honest replicas
    assert wiring.stages[1].bans.is_banned("liar") and stats.failures_by_server.get("liar") == 1, stats
    assert not wiring.stages[1].bans.is_banned("l1") and not wiring.stages[1].bans.is_banned("l2")
    assert stats.completed == STEPS and stats.dropped == 0


def test_outputs_agree_is_relative_and_rejects_non_finite():
    a = torch.randn(2, 8, 16)
    assert outputs_agree(a, a * 1.01, 0.1)
    assert not outputs_agree(a, a + 0.5 * a.std() * torch.randn_like(a), 0.1)
    assert not outputs_agree(a, a[:1], 0.1)
    bad = a.clone()
    bad[0, 0, 0] = float("nan")
    assert not outputs_agree(bad, bad, 0.1)
    for kwargs in ({"spot_check_prob": 1.5}, {"spot_check_prob": -0.1}, {"spot_check_tolerance": 0.0}):
        with pytest.raises(ValueError):
            SwarmConfig(**kwargs)
