"""The stage service and the trainer over in-process streams: exactness, hostile input, bounded memory, retries."""

import asyncio

import pytest
import torch

from peerd.models import build_model, split_model
from peerd.transport.inprocess import Hub
from protocols.rpc import Refused, call
from protocols.stage_service import PipelineTrainer, StageService, encode_tokens
from protocols.swarm import SwarmConfig, Wiring

pytestmark = pytest.mark.timeout(60)

SEQ_LEN = 32


def service_name(k: int) -> str:
    return f"run.swarm.stage{k}"


def batch(seed: int = 3, b: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, SEQ_LEN), generator=g), torch.randint(0, 256, (b, SEQ_LEN), generator=g)


async def start_servers(hub: Hub, stages, config: SwarmConfig, names_by_stage, **kwargs):
    services = {}
    for k, names in enumerate(names_by_stage):
        for name in names:
            service = StageService(service_name(k), stages[k] if len(names) == 1 else kwargs["copy"](k), config,
                                   **{a: v for a, v in kwargs.items() if a != "copy"})
            await service.start(hub.transport(name))
            services[name] = service
    return services


@pytest.mark.parametrize("num_stages", [2, 3])
def test_trainer_over_the_wire_matches_single_process(num_stages):
    """codec "none", one server per stage: loss and every gradient equal the unsplit model's."""
    async def main():
        model = build_model("tiny", seq_len=SEQ_LEN, seed=0)
        stages = split_model(model, num_stages)
        config = SwarmConfig(stages=num_stages, codec="none")
        hub = Hub()
        await start_servers(hub, stages, config, [[f"s{k}"] for k in range(num_stages)])
        wiring = Wiring(num_stages)
        wiring.set_servers({k: [f"s{k}"] for k in range(num_stages)})
        trainer = PipelineTrainer(hub.transport("trainer").streams, service_name, wiring, config, d_model=128)
        x, y = batch()
        loss = await trainer.step(x, y)
        _, ref_loss = model(x, y)
        ref_loss.backward()
        assert loss == pytest.approx(ref_loss.item(), abs=1e-6)
        ref = dict(model.named_parameters())
        offset = 0
        for stage in stages:
            for name, p in stage.named_parameters():
                if name == "head":
                    continue
                if name.startswith("blocks."):
                    _, i, rest = name.split(".", 2)
                    name = f"blocks.{offset + int(i)}.{rest}"
                got = p.grad + stages[-1].head.grad if name == "tok_emb.weight" else p.grad
                torch.testing.assert_close(got, ref[name].grad, rtol=1e-5, atol=1e-7, msg=name)
            offset += len(stage.blocks)
        assert wiring.stats.completed == 1 and wiring.stats.retried == 0

    asyncio.run(main())


def test_nan_activations_get_the_sender_banned():
    async def main():
        stages = split_model(build_model("tiny", seq_len=SEQ_LEN, seed=0), 2)
        config = SwarmConfig(codec="fp16")
        hub = Hub()
        services = await start_servers(hub, stages, config, [["s0"], ["s1"]])
        streams = hub.transport("evil").streams
        nan = torch.full((2, SEQ_LEN, 128), float("nan"))
        header = {"codec": "none", "dtype": "float32", "shape": [2, SEQ_LEN, 128]}
        payload = nan.numpy().tobytes()
        _, targets = batch(b=2)
        t_header, t_payload = encode_tokens(targets)
        with pytest.raises(Refused) as refused:
            await call(streams, "s1", service_name(1), "loss",
                       {"mb": "1", "x": header, "x_bytes": len(payload), "targets": t_header},
                       [payload, t_payload], timeout_s=10, max_reply_bytes=1 << 20)
        assert refused.value.code == "protocol"
        assert services["s1"].bans.is_banned("evil")
        with pytest.raises(Refused) as refused:  # banned: even a valid request is refused now
            await call(streams, "s1", service_name(1), "loss", {"mb": "2"}, b"", timeout_s=10)
        assert refused.value.code == "banned"
        # out-of-vocabulary token ids are a violation too
        bad = {"shape": [1, 2]}
        with pytest.raises(Refused):
            await call(hub.transport("evil2").streams, "s0", service_name(0), "forward",
                       {"mb": "1", "tokens": bad}, (300).to_bytes(4, "little") * 2, timeout_s=10)
        assert services["s0"].bans.is_banned("evil2")

    asyncio.run(main())


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_kept_inputs_are_bounded_and_expire():
    async def main():
        stages = split_model(build_model("tiny", seq_len=SEQ_LEN, seed=0), 2)
        clock = Clock()
        config = SwarmConfig(codec="fp16", max_pending=2, call_timeout_s=5.0, pending_timeout_s=10.0)
        hub = Hub()
        service = StageService(service_name(0), stages[0], config, clock=clock)
        await service.start(hub.transport("s0"))
        streams = hub.transport("t").streams
        x, _ = batch(b=1)
        h, p = encode_tokens(x)
        for mb in ("a", "b"):
            await call(streams, "s0", service_name(0), "forward", {"mb": mb, "tokens": h}, p, timeout_s=10,
                       max_reply_bytes=1 << 20)
        with pytest.raises(Refused) as refused:
            await call(streams, "s0", service_name(0), "forward", {"mb": "c", "tokens": h}, p, timeout_s=10,
                       max_reply_bytes=1 << 20)
        assert refused.value.code == "busy" and service.pending == 2
        clock.t = 11.0  # both expired: room again, and their backward is refused as unknown
        await call(streams, "s0", service_name(0), "forward", {"mb": "c", "tokens": h}, p, timeout_s=10,
                   max_reply_bytes=1 << 20)
        assert service.pending == 1
        g_header = {"codec": "none", "dtype": "float32", "shape": [1, SEQ_LEN, 128]}
        with pytest.raises(Refused) as refused:
            await call(streams, "s0", service_name(0), "backward", {"mb": "a", "g": g_header},
                       torch.zeros(1, SEQ_LEN, 128).numpy().tobytes(), timeout_s=10)
        assert refused.value.code == "unknown"

    asyncio.run(main())


class NaNService(StageService):
    """A hostile server: answers forward with NaN activations."""

    def _encode(self, x):
        return ({"codec": "none", "dtype": "float32", "shape": list(x.shape)},
                torch.full(x.shape, float("nan")).numpy().tobytes())


def test_trainer_bans_a_server_returning_nan_and_retries_on_its_replica():
    async def main():
        model = build_model("tiny", seq_len=SEQ_LEN, seed=0)
        stages = split_model(model, 2)
        config = SwarmConfig(codec="fp16")
        hub = Hub()
        await NaNService(service_name(0), split_model(model, 2)[0], config).start(hub.transport("evil"))
        await StageService(service_name(0), stages[0], config).start(hub.transport("good"))
        await StageService(service_name(1), stages[1], config).start(hub.transport("last"))
        wiring = Wiring(2, ban_s=3600.0)  # the ban must outlast the test on a slow machine
        wiring.set_servers({0: ["evil", "good"], 1: ["last"]})
        trainer = PipelineTrainer(hub.transport("trainer").streams, service_name, wiring, config, d_model=128)
        losses = [await trainer.step(*batch(seed=i)) for i in range(4)]
        assert all(loss is not None for loss in losses)
        assert wiring.stages[0].bans.is_banned("evil")
        assert wiring.stats.retried == 1 and wiring.stats.failures_by_server == {"evil": 1}
        assert wiring.stats.completed == wiring.stats.sent == 4 and wiring.stats.dropped == 0

    asyncio.run(main())
