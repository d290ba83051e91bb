"""The inner step's micro-batching, precision and activation checkpointing (CPU; autocast runs on CPU too)."""

import asyncio
import copy

import pytest
import torch

from peerd.config import ConfigError, NodeConfig
from peerd.commands.export import find_checkpoint, load_checkpoint_model
from peerd.worker.inner_step import InnerStep, Precision, micro_batch_count, resolve_precision
from peerd.models import build_model
from peerd.roles.base import RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams, flatten_parameters, make_inner_optimizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls: more threads than cores only adds contention on a shared machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

HP = DiLoCoHyperparams(inner_steps=3, warmup_steps=1, inner_lr=1e-3)
B, T = 8, 16


def _batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 256, (B, T + 1), generator=g)
        yield x[:, :-1], x[:, 1:]


def _train(micro: int, precision: str = "fp32", steps: int = 3, clip: float = 0.0, checkpointing: bool = False,
           sgd: bool = False):
    model = build_model("tiny", T, seed=1)
    model.activation_checkpointing = checkpointing
    # SGD moves parameters by lr * gradient, so parameters compare gradients; AdamW's first steps move each
    # parameter by ~lr * sign(gradient), which float summation order can flip for a near-zero gradient.
    opt = torch.optim.SGD(model.parameters(), lr=0.5) if sgd else make_inner_optimizer(model.parameters(), HP)
    step = InnerStep(model, opt, batch_size=B, micro_batch_size=micro, precision=Precision(precision, "cpu"),
                     grad_clip_norm=clip)
    losses = [step(x, y) for x, y in _batches(steps)]
    return model, losses


@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_micro_batches_accumulate_to_one_step_at_the_full_batch(micro, clip):
    whole, whole_losses = _train(0, clip=clip, sgd=True)
    parts, part_losses = _train(micro, clip=clip, sgd=True)
    for p, q in zip(parts.parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)  # the last step's gradient
    torch.testing.assert_close(flatten_parameters(parts), flatten_parameters(whole), rtol=1e-5, atol=1e-7)
    for a, b in zip(part_losses, whole_losses):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_one_micro_batch_is_bit_identical_to_a_plain_step():
    model = build_model("tiny", T, seed=1)
    opt = make_inner_optimizer(model.parameters(), HP)
    for x, y in _batches(3):  # the role's step before micro-batching existed
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    stepped, losses = _train(B)
    assert torch.equal(flatten_parameters(stepped), flatten_parameters(model))
    assert losses[-1].dtype == torch.float32 and losses[-1].dim() == 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_steps_keep_fp32_master_weights_and_track_the_fp32_loss(precision):
    reference, ref_losses = _train(0)
    model, losses = _train(4, precision=precision)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(loss) and loss.dtype == torch.float32 for loss in losses)
    for a, b in zip(losses, ref_losses):
        assert abs(float(a) - float(b)) < 0.05  # half-precision matmuls, same optimization
    moved = (flatten_parameters(model) - flatten_parameters(build_model("tiny", T, seed=1))).abs().max()
    assert moved > 0


def test_activation_checkpointing_gives_the_same_step():
    plain, _ = _train(2, sgd=True)
    recomputed, _ = _train(2, checkpointing=True, sgd=True)
    torch.testing.assert_close(flatten_parameters(recomputed), flatten_parameters(plain), rtol=1e-6, atol=1e-7)


def test_precision_and_micro_batch_validation():
    assert resolve_precision("auto", "cpu") == Precision("fp32", "cpu")
    assert resolve_precision("bf16", "cpu").dtype == torch.bfloat16
    assert resolve_precision("fp16", "cpu").loss_scaling
    with pytest.raises(ValueError):
        resolve_precision("fp8", "cpu")
    assert micro_batch_count(8, 0) == 1 and micro_batch_count(8, 2) == 4
    with pytest.raises(ValueError):
        micro_batch_count(8, 3)
    with pytest.raises(ConfigError):
        NodeConfig(precision="half")
    with pytest.raises(ConfigError):
        NodeConfig(micro_batch_size=-1)
    model = build_model("tiny", T, seed=1)
    step = InnerStep(model, make_inner_optimizer(model.parameters(), HP), batch_size=B, micro_batch_size=2)
    with pytest.raises(ValueError):
        step(torch.zeros(4, T, dtype=torch.long), torch.zeros(4, T, dtype=torch.long))


def _run() -> RunConfig:
    return RunConfig(model="tiny", seq_len=T, batch_size=B, eval_batches=0, diloco=HP,
                     averaging=AveragingConfig.from_flat(compression="none", min_group_size=2))


def _role(tmp_path, **node) -> DiLoCoRole:
    config = NodeConfig(checkpoint_dir=str(tmp_path), threads=1, device="cpu", **node)
    return DiLoCoRole(RunContext.build("unit", _run(), config, Hub().transport("solo")))


def test_role_with_a_micro_batch_that_does_not_divide_the_run_batch_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="micro_batch_size"):
        _role(tmp_path, micro_batch_size=3)


def test_role_trains_in_micro_batches_and_bf16_with_the_run_batch(tmp_path):
    async def main():
        fp32 = _role(tmp_path / "a")
        mixed = _role(tmp_path / "b", micro_batch_size=2, precision="bf16", activation_checkpointing=True)
        assert mixed.inner_step.accumulation == 4 and mixed.precision.name == "bf16"
        for role in (fp32, mixed):
            await role.train_until_quota()
            assert role.steps_since_sync == 3 and role.samples_since_sync == 3 * B
            assert role.stats.tokens == 3 * B * T
        assert abs(mixed.stats.last_loss - fp32.stats.last_loss) < 0.05
        # A new optimizer (after a failed round) gets a step that drives it.
        mixed.new_optimizer()
        assert mixed.inner_step.optimizer is mixed.optimizer
        # The role's checkpoint records what `peerd export` needs to rebuild its model.
        mixed.save_checkpoint()
        local = load_checkpoint_model(find_checkpoint(tmp_path / "b"), weights="local")
        assert torch.equal(flatten_parameters(local), flatten_parameters(mixed.model))

    asyncio.run(main())


def test_role_fp32_default_matches_a_plain_loop_bit_for_bit(tmp_path):
    async def main():
        role = _role(tmp_path)
        reference = copy.deepcopy(role.model)
        sampler = copy.deepcopy(role.sampler)
        await role.train_until_quota()
        opt = make_inner_optimizer(reference.parameters(), HP)
        from protocols.diloco import inner_lr_at, set_lr
        for step in range(3):
            set_lr(opt, inner_lr_at(step, HP))
            x, y = sampler.next_batch()
            _, loss = reference(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), HP.grad_clip_norm)
            opt.step()
        assert torch.equal(flatten_parameters(role.model), flatten_parameters(reference))
        assert role.stats.last_loss == float(loss)

    asyncio.run(main())
