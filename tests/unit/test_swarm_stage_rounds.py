"""Stage replicas average their stage's parameters in outer rounds (in-process transports)."""

import asyncio

import pytest
import torch

from peerd.roles.outer_sync import RoundResult
from peerd.run_config import RunConfig
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams, OuterState
from protocols.stage_service import flat_parameters
from protocols.swarm import StageAnnouncement, SwarmConfig
from tests.unit.test_swarm_role import _start_servers

pytestmark = pytest.mark.timeout(120)


def _run(**swarm) -> RunConfig:
    return RunConfig(model="tiny", seq_len=64, batch_size=8, eval_batches=0, parallelism="swarm",
                     swarm=SwarmConfig(stages=2, call_timeout_s=10.0, pending_timeout_s=30.0, sync_interval_s=0,
                                       **swarm),
                     diloco=DiLoCoHyperparams(inner_lr=3e-3, inner_weight_decay=0.0))


def _train_locally(role, scale: float, samples: int) -> None:
    """Stand-in for local steps: move the stage's parameters and count the samples they took."""
    gen = torch.Generator().manual_seed(int(scale * 1000))
    with torch.no_grad():
        for p in role.service.stage.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    role.service.samples += samples


async def _round(roles):
    return await asyncio.wait_for(asyncio.gather(*(r.sync_once() for r in roles)), 60)


def test_announcements_carry_the_outer_round():
    a = StageAnnouncement(1, 2.0, 0, 5, 3)
    assert StageAnnouncement.parse(a.to_dict(), 2) == a
    assert StageAnnouncement.parse({"stage": 1}, 2).outer_round == 0  # records of older peers
    for bad in (-1, True, 1.5, "2"):
        assert StageAnnouncement.parse({"stage": 1, "outer_round": bad}, 2) is None


def test_sync_interval_is_fingerprint_neutral_at_its_default():
    base = RunConfig(parallelism="swarm", model="tiny")
    assert RunConfig(parallelism="swarm", model="tiny", swarm=SwarmConfig(sync_interval_s=60.0)).fingerprint() \
        == base.fingerprint()
    assert RunConfig(parallelism="swarm", model="tiny", swarm=SwarmConfig(sync_interval_s=5.0)).fingerprint() \
        != base.fingerprint()
    with pytest.raises(ValueError, match="sync_interval_s"):
        SwarmConfig(sync_interval_s=-1.0)


def test_replicas_hold_equal_stage_parameters_after_a_stage_round(tmp_path):
    async def main():
        hub, stop = Hub(), asyncio.Event()
        roles, tasks = await _start_servers(hub, tmp_path, _run(), [0, 0, 1, 1], stop)
        before = []
        for i, role in enumerate(roles):
            _train_locally(role, 0.01 * (i + 1), samples=8 * (i + 1))
            before.append(flat_parameters(role.service.stage))
        outcomes = await _round(roles)
        after = [flat_parameters(r.service.stage) for r in roles]
        rounds = [r.sync_state.outer.outer_round for r in roles]
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return roles, outcomes, before, after, rounds

    roles, outcomes, before, after, rounds = asyncio.run(main())
    assert all(isinstance(o, RoundResult) and o.group_size == 2 for o in outcomes), outcomes
    assert rounds == [1, 1, 1, 1]
    assert torch.equal(after[0], after[1]) and torch.equal(after[2], after[3])
    for b, a in zip(before, after):
        assert not torch.equal(a, b)
    # the stages averaged among themselves: a stage-0 round never mixed stage 1's parameters
    assert after[0].numel() != after[2].numel() or not torch.equal(after[0], after[2])
    # theta_local is the new theta_outer (no steps were taken while the round ran)
    assert torch.equal(after[0], roles[0].sync_state.outer.theta)


def test_a_movers_parameters_equal_its_new_stage_mates_after_its_first_stage_round(tmp_path):
    async def main():
        hub, stop = Hub(), asyncio.Event()
        run = _run(rebalance_period_s=3600.0)  # moves only when the test asks, after the first round
        roles, tasks = await _start_servers(hub, tmp_path, run, [0, 0, 0, 1], stop)
        for i, role in enumerate(roles):
            _train_locally(role, 0.01 * (i + 1), samples=16)
        first = await _round(roles)  # stage 1 is now at outer round 1, its theta_outer no longer the initial one
        for role in roles[:3]:
            if await role.rebalance_once() is not None:
                break
        stage1 = [r for r in roles if r.stage == 1]
        for i, role in enumerate(stage1):  # both train on the new stage before its next round
            _train_locally(role, 0.05 * (i + 1), samples=8)
        second = await _round(stage1)
        params = [flat_parameters(r.service.stage) for r in stage1]
        rounds = [r.sync_state.outer.outer_round for r in stage1]
        moves = [r.moves for r in roles]
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return first, second, params, rounds, moves

    first, second, params, rounds, moves = asyncio.run(main())
    assert all(isinstance(o, RoundResult) for o in first), first
    assert sorted(m for ms in moves for m in ms) == [(0, 1)], moves
    assert all(isinstance(o, RoundResult) and o.group_size == 2 for o in second), second
    assert rounds == [2, 2]
    assert torch.equal(params[0], params[1])


def test_a_replica_that_missed_rounds_adopts_its_stage_mates_outer_state(tmp_path):
    async def main():
        hub, stop = Hub(), asyncio.Event()
        roles, tasks = await _start_servers(hub, tmp_path, _run(), [0, 0, 1], stop)
        for role in roles:
            _train_locally(role, 0.02, samples=8)
        await _round(roles)
        await _round(roles)
        restarted = roles[1]  # back at round 0 from its own parameters, as after a restart without a checkpoint
        frag = restarted.sync_state.fragment
        restarted.sync_state.outer = OuterState.initial(frag.flatten(restarted.service.stage) + 0.5)
        await restarted.announce()
        _train_locally(roles[0], 0.03, samples=8)
        outcomes = await _round(roles[:2])
        params = [flat_parameters(r.service.stage) for r in roles[:2]]
        rounds = [r.sync_state.outer.outer_round for r in roles[:2]]
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return outcomes, params, rounds

    outcomes, params, rounds = asyncio.run(main())
    assert all(isinstance(o, RoundResult) and o.group_size == 2 for o in outcomes), outcomes
    assert rounds == [3, 3]
    assert torch.equal(params[0], params[1])


def test_a_stage_round_is_the_samples_weighted_average_of_the_replicas(tmp_path):
    """SWARM's semantics: after a round every replica holds sum_i w_i theta_i / sum_i w_i, whatever the run's
    [diloco] outer step says (it is DiLoCo's 0.7 / Nesterov 0.9 here); in the second round too, where momentum from
    the first would show."""
    async def main():
        hub, stop = Hub(), asyncio.Event()
        roles, tasks = await _start_servers(hub, tmp_path, _run(), [0, 0], stop)
        locals_, weights, after = [], [1, 3], []
        for rnd in range(2):  # the second round would show momentum from the first
            for i, role in enumerate(roles):
                _train_locally(role, 0.01 * (i + 1) * (rnd + 1), samples=8 * weights[i])
            locals_.append([flat_parameters(r.service.stage) for r in roles])
            await _round(roles)
            after.append([flat_parameters(r.service.stage) for r in roles])
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return locals_, weights, after

    locals_, weights, after = asyncio.run(main())
    assert _run().diloco.outer_lr == 0.7 and _run().diloco.outer_momentum == 0.9
    for before, now in zip(locals_, after):
        expected = (weights[0] * before[0] + weights[1] * before[1]) / sum(weights)
        assert torch.equal(now[0], now[1])
        # the default compression sends the pseudo-gradients (about 0.01-0.04 here) in fp16: ~1e-5 of rounding
        torch.testing.assert_close(now[0], expected, rtol=0, atol=2e-4)
