"""Several local devices as one peer: 2 processes (gloo, CPU) take the same inner steps as one process on the
whole batch, and stay bit-identical to the daemon's model after outer-round writes and a new optimizer."""

import asyncio

import pytest
import torch

from peerd.config import ConfigError, NodeConfig
from peerd.worker.inner_step import InnerStep, Precision
from peerd.worker.local_dp import LocalDataParallel, LocalDevicesError, ReplicaSpec, check_local_devices, slice_size
from peerd.models import build_model
from peerd.roles.base import RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams, flatten_parameters, set_lr

HP = DiLoCoHyperparams(inner_steps=3, warmup_steps=1, inner_lr=1e-3, grad_clip_norm=1.0)
B, T = 8, 16


def _sgd(params, device_type):
    # SGD with momentum moves parameters linearly in the gradients, so parameters compare to tight tolerances
    # (AdamW's first steps move by ~lr * sign(gradient), which float summation order flips near 0) and its
    # momentum buffers are optimizer state the helpers must receive.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 256, (B, T + 1), generator=g)
        yield x[:, :-1], x[:, 1:]


@pytest.mark.timeout(20)
def test_local_devices_are_validated_without_touching_a_device():
    assert check_local_devices(["cpu", "cpu"]) == ("cpu", "cpu")
    assert check_local_devices(("cuda:0", "cuda:1")) == ("cuda:0", "cuda:1")
    for bad, why in ((["cuda:0", "cuda:0"], "twice"), (["cpu", "cuda:1"], "mixes"), (["gpu0"], "cpu or cuda:N"),
                     (["cuda"], "cpu or cuda:N")):
        with pytest.raises(LocalDevicesError, match=why):
            check_local_devices(bad)
        with pytest.raises(ConfigError, match=why):
            NodeConfig(local_devices=tuple(bad))
    with pytest.raises(ConfigError, match="contradicts local_devices"):
        NodeConfig(device="cpu", local_devices=("cuda:0", "cuda:1"))
    with pytest.raises(ConfigError, match="contradicts local_devices"):
        NodeConfig(device="cuda:1", local_devices=("cuda:0", "cuda:1"))
    assert NodeConfig(device="cuda", local_devices=("cuda:0", "cuda:1")).local_devices == ("cuda:0", "cuda:1")
    with pytest.raises(ConfigError, match="gpu = false"):
        NodeConfig(gpu=False, local_devices=("cuda:0", "cuda:1"))
    assert NodeConfig(local_devices=("cpu", "cpu")).local_devices == ("cpu", "cpu")
    assert slice_size(8, 2) == 4 and slice_size(8, 2, 2) == 4
    with pytest.raises(LocalDevicesError, match="multiple of the 3 local devices"):
        slice_size(8, 3)
    with pytest.raises(LocalDevicesError, match="8 / 2 = 4 sequences"):
        slice_size(8, 2, 3)
    if torch.cuda.device_count() < 64:
        spec = ReplicaSpec("tiny", T, 1, 256, HP, B)
        with pytest.raises(LocalDevicesError, match="cuda:63 not present"):
            LocalDataParallel(torch.nn.Linear(2, 2), ["cuda:62", "cuda:63"], spec)  # refused before any use


@pytest.mark.timeout(240)
def test_two_cpu_processes_step_like_one_process_on_the_whole_batch():
    torch.set_num_threads(1)
    spec = ReplicaSpec("tiny", T, 1, 256, HP, B, micro_batch_size=2, grad_clip_norm=HP.grad_clip_norm, threads=1,
                       optimizer=_sgd)
    model = build_model("tiny", T, seed=1)
    reference = build_model("tiny", T, seed=1)
    opt, ref_opt = _sgd(model.parameters(), "cpu"), _sgd(reference.parameters(), "cpu")
    ref_step = InnerStep(reference, ref_opt, batch_size=B, precision=Precision("fp32", "cpu"),
                         grad_clip_norm=HP.grad_clip_norm)
    dp = LocalDataParallel(model, ["cpu", "cpu"], spec)
    try:
        step = dp.inner_step(opt)

        def both(x, y, lr):
            set_lr(opt, lr)
            set_lr(ref_opt, lr)
            loss, ref_loss = step(x, y), ref_step(x, y)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)  # the whole batch's mean loss
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7)  # averaged = whole-batch gradient
            torch.testing.assert_close(flatten_parameters(model), flatten_parameters(reference), rtol=1e-5,
                                       atol=1e-6)

        batches = _batches(7)
        for i in range(3):
            both(*next(batches), 0.1 * (i + 1))
        digests = dp.replica_digests()
        assert len(digests) == 2 and digests[0] == digests[1]

        # an outer round writes theta_outer into the daemon's model: the helper gets it before the next step
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference.parameters()):
                p.mul_(0.5)
                q.mul_(0.5)
        both(*next(batches), 0.2)
        assert len(set(dp.replica_digests())) == 1

        # a new inner optimizer (the role's after a diverged round): its empty momentum replaces the helper's
        opt, ref_opt = _sgd(model.parameters(), "cpu"), _sgd(reference.parameters(), "cpu")
        step = dp.inner_step(opt)
        ref_step = InnerStep(reference, ref_opt, batch_size=B, precision=Precision("fp32", "cpu"),
                             grad_clip_norm=HP.grad_clip_norm)
        for _ in range(2):
            both(*next(batches), 0.1)
        assert len(set(dp.replica_digests())) == 1

        # a helper that died (out of memory on its GPU, killed): the next step says so instead of waiting for it
        dp._helpers[0].kill()
        dp._helpers[0].join(10)
        with pytest.raises(RuntimeError, match="helper for cpu exited"):
            step(*next(batches))
    finally:
        dp.close()
    assert all(not h.is_alive() for h in dp._helpers)


def _role(tmp_path, **node) -> DiLoCoRole:
    run = RunConfig(model="tiny", seq_len=T, batch_size=B, eval_batches=0, diloco=HP,
                    averaging=AveragingConfig.from_flat(compression="none", min_group_size=2))
    config = NodeConfig(checkpoint_dir=str(tmp_path), threads=1, device="cpu", **node)
    return DiLoCoRole(RunContext.build("unit", run, config, Hub().transport("solo")))


@pytest.mark.timeout(240)
def test_a_diloco_role_on_two_local_devices_keeps_its_replicas_identical(tmp_path):
    with pytest.raises(ConfigError, match="multiple of the 3 local devices"):
        _role(tmp_path / "three", local_devices=("cpu", "cpu", "cpu"))
    role = _role(tmp_path, local_devices=("cpu", "cpu"), micro_batch_size=2, activation_checkpointing=True)
    try:
        async def main():
            await role.train_until_quota()
            assert role.steps_since_sync == 3 and role.stats.tokens == 3 * B * T
            assert role.inner_step.accumulation == 2  # 4 sequences per device in micro-batches of 2
            assert len(set(role.local_dp.replica_digests())) == 1
            # an outer round (theta_local := theta_outer) and a fresh inner AdamW, as after a diverged round
            role.new_optimizer()
            role.restart_local()
            await role.train_until_quota()
            assert int(role.optimizer.state[next(role.model.parameters())]["step"]) == 3
            assert len(set(role.local_dp.replica_digests())) == 1
            assert role.stats.last_loss is not None and role.stats.last_loss < 6.0

        asyncio.run(main())
    finally:
        role.local_dp.close()
