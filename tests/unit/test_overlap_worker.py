"""DiLoCo workers with ``[diloco] overlap = "delayed"`` (and fp4 / top-k codecs) on the in-process transport."""

import asyncio

import pytest
import torch

from peerd.config import ConfigError, NodeConfig
from peerd.roles.base import RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceFailed
from protocols.diloco import DelayedOuterStep, DiLoCoHyperparams, OuterState, flatten_parameters

pytestmark = pytest.mark.timeout(120)


def _run(overlap="delayed", compression="none", max_outer_rounds=0) -> RunConfig:
    return RunConfig(
        model="tiny", seq_len=32, batch_size=4, eval_batches=0, max_outer_rounds=max_outer_rounds,
        diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=2, inner_lr=1e-3, overlap=overlap),
        averaging=AveragingConfig.from_flat(compression=compression, min_group_size=2, matchmaking_timeout_s=4.0,
                                            request_timeout_s=1.0, sender_timeout_s=3.0, reducer_timeout_s=6.0),
    )


def _worker(hub, name, run, tmp_path) -> DiLoCoRole:
    node = NodeConfig(checkpoint_dir=str(tmp_path / name), threads=1, device="cpu")
    return DiLoCoRole(RunContext.build("unit", run, node, hub.transport(name)))


async def _start(workers):
    for w in workers:
        for component in w.components:
            await component.start()
        await w.publish_status()


async def _boundary(workers):
    for w in workers:
        await w.train_until_quota()
    await asyncio.gather(*[w.run_round() for w in workers])


def test_overlap_is_fingerprint_neutral_at_its_default_and_refused_with_mixing_methods():
    base = RunConfig(model="tiny")
    assert RunConfig(model="tiny", diloco=DiLoCoHyperparams(overlap="none")).fingerprint() == base.fingerprint()
    assert RunConfig(model="tiny", diloco=DiLoCoHyperparams(overlap="delayed")).fingerprint() != base.fingerprint()
    assert "overlap" not in base.fingerprint_dict()["diloco"]
    with pytest.raises(ValueError, match="overlap"):
        DiLoCoHyperparams(overlap="eager")
    with pytest.raises(ConfigError, match="overlap"):
        RunConfig(diloco=DiLoCoHyperparams(overlap="delayed"), averaging=AveragingConfig(method="gossip"))
    assert RunConfig.from_dict({"diloco": {"overlap": "delayed"}}).diloco.overlap == "delayed"


def test_delayed_rounds_land_between_inner_steps_merge_theta_local_and_stay_bit_identical(tmp_path):
    async def main():
        hub = Hub()
        workers = [_worker(hub, f"peer-{c}", _run(), tmp_path) for c in "abc"]
        await _start(workers)
        hp = workers[0].hp
        theta0 = workers[0].outer.theta.clone()
        # round 0: its pseudo-gradient goes to the background all-reduce; theta_local goes on, no restart
        for w in workers:
            await w.train_until_quota()
        locals0 = [flatten_parameters(w.model) for w in workers]
        deltas0 = [theta0 - local for local in locals0]
        await asyncio.gather(*[w.run_round() for w in workers])
        assert all(w.outer.outer_round == 0 and torch.equal(w.outer.theta, theta0) for w in workers)
        assert all(w.rounds.in_flight is not None and w.steps_since_sync == 0 for w in workers)
        assert all(torch.equal(flatten_parameters(w.model), local) for w, local in zip(workers, locals0))
        in_flight = [w.rounds.in_flight for w in workers]
        await asyncio.gather(*in_flight)
        averaged0 = in_flight[0].result()[0][0].averaged
        assert all(torch.equal(t.result()[0][0].averaged, averaged0) for t in in_flight)
        torch.testing.assert_close(averaged0, sum(deltas0) / 3, rtol=1e-5, atol=1e-7)
        # between two inner steps the finished all-reduce lands: outer step, then the merge of theta_local
        before = [flatten_parameters(w.model) for w in workers]
        assert not any([await w.rounds.between_steps() for w in workers])
        reference = DelayedOuterStep(OuterState.initial(theta0)).complete(averaged0, hp)
        assert all(w.outer.digest() == reference.state.digest() and w.rounds.in_flight is None for w in workers)
        for w, local in zip(workers, before):
            assert torch.equal(flatten_parameters(w.model), reference.merge(local, hp))
        # round 1's pseudo-gradients are taken against the new theta_outer
        for w in workers:
            await w.train_until_quota()
        deltas1 = [reference.state.theta - flatten_parameters(w.model) for w in workers]
        await asyncio.gather(*[w.run_round() for w in workers])
        await asyncio.gather(*[w.rounds.in_flight for w in workers])
        averaged1 = workers[0].rounds.in_flight.result()[0][0].averaged
        torch.testing.assert_close(averaged1, sum(deltas1) / 3, rtol=1e-5, atol=1e-7)
        await _boundary(workers)  # an all-reduce still unlanded at the boundary lands there, before round 2 launches
        assert all(w.outer.outer_round == 2 for w in workers)
        assert len({w.outer.digest() for w in workers}) == 1
        assert reference.state.apply(averaged1, hp).digest() == workers[0].outer.digest()
        assert all(w.stats.rounds_ok == 2 and w.stats.rounds_failed == 0 for w in workers)

    asyncio.run(main())


def test_a_failed_background_round_keeps_theta_outer_and_carries_its_steps(tmp_path):
    async def main():
        hub = Hub()
        a, b = (_worker(hub, name, _run(), tmp_path) for name in ("peer-a", "peer-b"))
        await _start([a, b])
        for w in (a, b):
            real_run = w.sync.allreduce.run
            fired = []

            async def failing_run(group, tensor, weight, out=None, real_run=real_run, fired=fired):
                if len(fired) < 2:  # both fail both attempts of round 0: the round fails
                    fired.append(1)
                    raise AllReduceFailed("injected")
                return await real_run(group, tensor, weight, out)

            w.sync.allreduce.run = failing_run
        await _boundary([a, b])  # launch round 0 (it will fail)
        start = a.outer.digest()
        for w in (a, b):
            await w.train_until_quota()
        await asyncio.gather(a.run_round(), b.run_round())  # lands the failure, launches round 0 again
        assert a.outer.digest() == b.outer.digest() == start
        assert a.stats.rounds_failed == b.stats.rounds_failed == 1
        assert a.rounds.carry is None  # the carry went into the relaunched round
        outcome, _, weight, steps, _, _ = await a.rounds.in_flight
        assert (weight, steps) == (24.0, 6) and isinstance(outcome, tuple)  # both rounds' samples and steps
        await _boundary([a, b])  # lands it: 6 steps of each peer in one average
        assert a.outer.outer_round == b.outer.outer_round == 1
        assert a.outer.digest() == b.outer.digest() != start
        assert a.stats.rounds_ok == 1

    asyncio.run(main())


@pytest.mark.parametrize("compression", ["fp4", "topk"])
def test_workers_train_with_overlap_and_compression_until_max_rounds(compression, tmp_path):
    async def main():
        hub = Hub()
        run = _run(compression=compression, max_outer_rounds=3)
        workers = [_worker(hub, f"peer-{c}", run, tmp_path) for c in "ab"]
        await asyncio.gather(*[w.run() for w in workers])
        assert [w.outer.outer_round for w in workers] == [3, 3]  # drained, not overshooting
        assert workers[0].outer.digest() == workers[1].outer.digest()
        assert all(w.rounds.in_flight is None for w in workers)
        if compression == "topk":
            assert all(float(w.sync.feedback.error.abs().sum()) > 0 for w in workers)
        else:
            assert all(w.sync.feedback is None for w in workers)

    asyncio.run(main())


def test_sparse_codecs_are_refused_where_outer_states_are_averaged():
    with pytest.raises(ConfigError, match="topk"):
        RunConfig(averaging=AveragingConfig.from_flat(method="gossip", compression="topk"))
    with pytest.raises(ConfigError, match="topk"):
        RunConfig(averaging=AveragingConfig.from_flat(method="moshpit", compression="topk"))
    run = RunConfig(averaging=AveragingConfig.from_flat(compression="topk"))
    assert run.averaging.allreduce().compression == "topk"
