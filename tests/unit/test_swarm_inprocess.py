"""An in-process swarm: 2 stages x 2 servers + 1 trainer push micro-batches of Shakespeare through the stages."""

import asyncio
import copy

import pytest
import torch

from peerd.data.corpus import WindowSampler, load_corpus
from peerd.models import build_model, split_model
from peerd.transport.inprocess import Hub
from protocols.stage_service import PipelineTrainer, StageService
from protocols.swarm import SwarmConfig, Wiring

SEQ_LEN = 64
STEPS = 40
KILL_AT = 12


def service_name(k: int) -> str:
    return f"run.swarm.stage{k}"


class KilledOnBackward(StageService):
    """A server whose process dies during a backward once ``armed``: the trainer loses it mid micro-batch."""

    hub: Hub
    me: str
    armed = False
    killed = False

    async def rpc_backward(self, request):
        if self.armed and not self.killed:
            self.killed = True
            self.hub.disconnect(self.me)
        return await super().rpc_backward(request)


@pytest.mark.timeout(120)
def test_swarm_trains_through_a_killed_server():
    async def main():
        torch.manual_seed(0)
        corpus = load_corpus("shakespeare")
        sampler = WindowSampler(corpus.train, SEQ_LEN, 8, seed=0)
        stages = split_model(build_model("tiny", seq_len=SEQ_LEN, seed=0), 2)
        config = SwarmConfig(codec="fp16", call_timeout_s=10.0, pending_timeout_s=30.0)
        hub = Hub()
        services = {}
        for k, names in enumerate([["s0a", "s0b"], ["s1a", "s1b"]]):
            for name in names:
                module = copy.deepcopy(stages[k])
                optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.0)
                cls = KilledOnBackward if name == "s0b" else StageService
                service = cls(service_name(k), module, config, optimizer=optimizer)
                service.hub, service.me = hub, name
                await service.start(hub.transport(name))
                services[name] = service
        wiring = Wiring(2, ban_s=60.0)
        wiring.set_servers({0: ["s0a", "s0b"], 1: ["s1a", "s1b"]})
        # every call "takes" one tick: equal measured throughputs, so the wiring (and which micro-batch meets the
        # kill) does not depend on the load of the machine running the test
        ticks = iter(range(10**6))
        trainer = PipelineTrainer(hub.transport("trainer").streams, service_name, wiring, config, d_model=128,
                                  clock=lambda: float(next(ticks)))
        losses = []
        for step in range(STEPS):
            if step == KILL_AT:
                services["s0b"].armed = True
            x, y = sampler.next_batch()
            losses.append(await trainer.step(x.long(), y.long()))
        return services, wiring, losses

    services, wiring, losses = asyncio.run(main())
    stats = wiring.stats
    assert services["s0b"].killed
    # nothing lost silently: every micro-batch completed (the replica took over), the failure was retried
    assert stats.sent == STEPS and stats.completed == STEPS and stats.dropped == 0
    assert stats.retried >= 1 and stats.failures_by_server.get("s0b", 0) >= 1
    assert all(loss is not None for loss in losses)
    # both replicas of each stage did work before the kill; only s0a after it
    assert services["s0a"].backwards + services["s0b"].backwards == STEPS
    assert services["s0b"].backwards <= KILL_AT and services["s0b"].backwards >= 3
    assert services["s1a"].backwards + services["s1b"].backwards == STEPS + 0
    assert min(services["s1a"].backwards, services["s1b"].backwards) >= 5
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, losses
