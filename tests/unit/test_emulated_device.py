"""The emulated accelerator (peerd.testing.emulated_device): each step takes exactly its step time by the injected
clock, updates the parameters deterministically, and reaches a real worker only through the context hook."""

import asyncio
import dataclasses

import pytest
import torch

from peerd.config import NodeConfig
from peerd.models import build_model
from peerd.roles.base import CONTEXT_HOOK_ENV, RunContext, wrap_context
from peerd.roles.diloco import DiLoCoRole
from peerd.run_config import AveragingConfig, RunConfig
from peerd.testing.emulated_device import ENV, GPU_STEP_S, EmulatedDevice, EmulatedStep, install
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams, flatten_parameters

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    """``clock()`` reads ``now``; ``sleep(s)`` records ``s`` and advances ``now`` by it."""

    def __init__(self):
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class CostlyStep(EmulatedStep):
    """An emulated step whose update costs ``cost`` seconds of the fake clock."""

    cost = 0.0

    def update(self, k):
        self.clock.now += self.cost
        return super().update(k)


def _model():
    return build_model("tiny", 16, seed=0)


def test_the_default_step_time_is_the_gpu_table_s_1p1b_step():
    assert GPU_STEP_S == pytest.approx(16 * 1024 / 53_476)
    assert 0.30 < GPU_STEP_S < 0.31


@pytest.mark.parametrize("cost", [0.0, 0.04, 0.2999])
def test_each_step_takes_exactly_the_step_time_whatever_its_update_costs(cost):
    clock = FakeClock()
    step = CostlyStep(_model(), EmulatedDevice(step_s=0.3, slices=4), clock=clock, sleep=clock.sleep)
    step.cost = cost
    for k in range(1, 6):
        step(None, None)
        assert clock.now == pytest.approx(0.3 * k, abs=1e-12)
    assert clock.slept == pytest.approx([0.3 - cost] * 5, abs=1e-12)
    assert step.steps == 5 and step.overruns == 0


def test_a_step_whose_update_outlasts_the_step_time_does_not_sleep_and_is_counted():
    clock = FakeClock()
    step = CostlyStep(_model(), EmulatedDevice(step_s=0.1, slices=4), clock=clock, sleep=clock.sleep)
    step.cost = 0.25
    step(None, None)
    assert clock.slept == [] and clock.now == pytest.approx(0.25) and step.overruns == 1


def test_the_slices_partition_the_parameters():
    step = EmulatedStep(_model(), EmulatedDevice(slices=7), sleep=lambda s: None)
    bounds = [step.slice_bounds(k) for k in range(7)]
    total = sum(p.numel() for p in step.model.parameters())
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_the_update_is_deterministic_and_touches_every_parameter_once_per_pass_of_the_slices():
    device = EmulatedDevice(step_s=1.0, slices=5, decay=0.01)
    clock = FakeClock()
    models = [_model(), _model()]
    theta0 = flatten_parameters(models[0]).clone()
    steps = [EmulatedStep(m, device, clock=clock, sleep=clock.sleep) for m in models]
    losses = [[float(s(None, None)) for _ in range(3)] for s in steps]
    a, b = (flatten_parameters(m) for m in models)
    assert torch.equal(a, b) and losses[0] == losses[1]  # same start, same steps: the same theta_local, bit for bit
    assert not torch.equal(a, theta0)
    for s in steps:
        s(None, None), s(None, None)  # the 4th and 5th slices: one whole pass
    after = flatten_parameters(models[0])
    expected = theta0.clone()
    for k in range(5):
        lo, hi = steps[0].slice_bounds(k)
        expected[lo:hi].mul_(1 - 0.01)
    assert torch.equal(after, expected)  # every element multiplied by 1 - decay exactly once
    assert (after - theta0).abs().max() > 0  # a pseudo-gradient of the model's size, not zeros


def test_bad_settings_are_refused():
    for bad in (dict(step_s=0), dict(slices=0), dict(decay=1.0), dict(decay=0.0)):
        with pytest.raises(ValueError):
            EmulatedDevice(**bad)
    with pytest.raises(ValueError, match=ENV):
        EmulatedDevice.from_json('{"step_seconds": 1}')
    assert EmulatedDevice.from_json(EmulatedDevice(step_s=0.5, slices=3).to_json()) == EmulatedDevice(0.5, 3)


def test_the_hook_puts_emulated_steps_into_a_real_worker(tmp_path, monkeypatch):
    """Through the context hook a DiLoCo worker's inner steps are the emulated device's (the model's parameters
    move exactly as the emulation says); a step rebuilt later (fresh optimizer) counts on."""
    device = EmulatedDevice(step_s=0.001, slices=3, decay=0.5)
    for name, value in device.environ().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PEERD_FAULTS", raising=False)
    run = RunConfig(model="tiny", seq_len=16, batch_size=2, eval_batches=0,
                    diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=1, inner_lr=1e-3),
                    averaging=AveragingConfig.from_flat(compression="none", min_group_size=2))
    node = NodeConfig(checkpoint_dir=str(tmp_path / "p"), threads=1, device="cpu")
    ctx = wrap_context(RunContext.build("unit", run, node, Hub().transport("p")))
    assert ctx.wrap_inner_step is not RunContext.wrap_inner_step

    async def main():
        worker = DiLoCoRole(ctx)
        theta0 = flatten_parameters(worker.model).clone()
        await worker.train_until_quota()
        assert isinstance(worker.inner_step, EmulatedStep) and worker.inner_step.steps == 3
        reference = EmulatedStep(build_model("tiny", 16, 0), device, sleep=lambda s: None)
        for _ in range(3):
            reference(None, None)
        assert torch.equal(flatten_parameters(worker.model), flatten_parameters(reference.model))
        assert not torch.equal(flatten_parameters(worker.model), theta0)
        worker.new_optimizer()
        assert worker.inner_step.steps == 3  # goes on from where the last step stopped

    asyncio.run(main())


def test_without_its_settings_the_hook_leaves_the_context_alone(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("PEERD_FAULTS", raising=False)

    @dataclasses.dataclass
    class Ctx:
        wrap_inner_step: object = None

    ctx = Ctx()
    assert wrap_context(ctx, {CONTEXT_HOOK_ENV: "peerd.testing.emulated_device:install_from_env"}) is ctx
    assert isinstance(install(ctx, EmulatedDevice()).wrap_inner_step(EmulatedStep(_model(), EmulatedDevice())),
                      EmulatedStep)
