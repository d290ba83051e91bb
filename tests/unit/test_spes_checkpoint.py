"""Checkpoint and resume of the SPES role (in-process): a peer stopped after a sync and rebuilt from its checkpoint
continues at its round with identical parameters, AdamW state, claim and sampler, and ends bit-identical to a peer
that never stopped."""

import asyncio

import pytest
import torch

from peerd.worker.checkpoint_file import CheckpointError
from peerd.config import NodeConfig
from peerd.roles.base import RunContext
from peerd.roles.spes import SpesRole
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams
from protocols.spes import SpesConfig

pytestmark = pytest.mark.timeout(180)


def _run(**spes) -> RunConfig:
    return RunConfig(
        model="tiny-moe", parallelism="spes", seq_len=32, batch_size=4, eval_batches=1, max_outer_rounds=3,
        diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=2, inner_lr=1e-3),
        spes=SpesConfig(sync_steps=3, merge_interval=2, merge_decay_steps=100, experts_per_peer=3, **spes),
        averaging=AveragingConfig.from_flat(compression="none", matchmaking_timeout_s=4.0, request_timeout_s=1.0,
                                            sender_timeout_s=3.0, reducer_timeout_s=6.0),
    )


def _peer(run, checkpoint_dir) -> SpesRole:
    node = NodeConfig(checkpoint_dir=str(checkpoint_dir), threads=1, device="cpu", status_interval_s=0.2,
                      status_ttl_s=5.0)
    return SpesRole(RunContext.build("spes-ckpt", run, node, Hub().transport("solo")))


def _optimizer_state(role: SpesRole) -> dict:
    return {(i, k): torch.as_tensor(v).clone() for i, st in role.optimizer.state_dict()["state"].items()
            for k, v in st.items()}


def test_a_stopped_peer_resumes_at_its_round_and_ends_identical_to_one_that_never_stopped(tmp_path):
    run = _run()
    straight = _peer(run, tmp_path / "straight")
    asyncio.run(straight.run())
    assert straight.outer_round == 3

    first = _peer(run, tmp_path / "resumed")
    first.ctx.events.subscribe(lambda e: first.ctx.stop.set() if e.name == "outer_round" and e.outer_round == 2
                               else None)
    asyncio.run(first.run())
    assert first.outer_round == 2 and first.steps_since_sync == 0
    stopped_params = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    stopped_state, stopped_own = _optimizer_state(first), first.own

    rebuilt = _peer(run, tmp_path / "resumed")
    resumed = []
    rebuilt.ctx.events.subscribe(lambda e: resumed.append(e) if e.name == "resume" else None)
    rebuilt.resume()
    assert [e.outer_round for e in resumed] == [2]
    assert rebuilt.outer_round == 2 and rebuilt.global_step == 6
    assert rebuilt.own == stopped_own and len(stopped_own) == 3
    for name, p in rebuilt.model.named_parameters():
        assert torch.equal(p, stopped_params[name]), name
    state = _optimizer_state(rebuilt)
    assert state.keys() == stopped_state.keys() and state
    assert all(torch.equal(state[k], stopped_state[k]) for k in state)
    # only its own experts are trained again
    trainable = {n for n, p in rebuilt.model.named_parameters() if p.requires_grad}
    held, not_held = min(stopped_own), min(set(range(8)) - stopped_own)
    assert any(f".experts.{held}." in n for n in trainable)
    assert not any(f".experts.{not_held}." in n for n in trainable)

    again = _peer(run, tmp_path / "resumed")
    asyncio.run(again.run())
    assert again.outer_round == 3
    for name, p in again.model.named_parameters():
        assert torch.equal(p, dict(straight.model.named_parameters())[name]), name


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path):
    first = _peer(_run(), tmp_path)
    first.ctx.events.subscribe(lambda e: first.ctx.stop.set() if e.name == "outer_round" else None)
    asyncio.run(first.run())
    other = _peer(_run(alpha_0=0.5), tmp_path)
    with pytest.raises(CheckpointError, match="another configuration"):
        other.resume()
