"""Streaming DiLoCo's fragments with the delayed overlap: each fragment's all-reduce overlaps the next inner steps."""

import asyncio

import pytest
import torch

from peerd.config import NodeConfig
from peerd.events import RoundDone, RoundFailed
from peerd.roles.base import RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from peerd.worker.rounds import DelayedFragmentRounds, RoundEnd
from protocols.allreduce import AllReduceFailed
from protocols.diloco import DelayedOuterStep, DiLoCoHyperparams

pytestmark = pytest.mark.timeout(180)

H, F = 4, 2


def _run(max_outer_rounds=0) -> RunConfig:
    return RunConfig(
        model="tiny", seq_len=32, batch_size=4, eval_batches=0, max_outer_rounds=max_outer_rounds,
        diloco=DiLoCoHyperparams(inner_steps=H, warmup_steps=2, inner_lr=1e-3, fragments=F, overlap="delayed"),
        averaging=AveragingConfig.from_flat(compression="none", min_group_size=2, matchmaking_timeout_s=30.0,
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


def test_each_fragment_s_allreduce_overlaps_the_next_inner_steps_and_theta_outer_stays_bit_identical(tmp_path):
    async def main():
        hub = Hub()
        workers = [_worker(hub, f"peer-{c}", _run(), tmp_path) for c in "abc"]
        done = []
        workers[0].ctx.events.subscribe(lambda e: done.append(e) if isinstance(e, RoundDone) else None)
        await _start(workers)
        assert all(isinstance(w.rounds, DelayedFragmentRounds) for w in workers)
        hp = workers[0].hp
        initial = [p.outer for p in workers[0].parts]
        # fragment 0's boundary (H/F steps): its pseudo-gradient goes to the background, theta_local trains on
        for w in workers:
            await w.train_until_quota()
        assert all(w.steps_since_sync == H // F for w in workers)
        locals0 = [w.parts[0].fragment.flatten(w.model) for w in workers]
        assert await asyncio.gather(*[w.run_round() for w in workers]) == [RoundEnd.SENT] * 3
        assert all(w.rounds.in_flight is not None and w.rounds.in_flight[0] == 0 for w in workers)
        assert all(w.rounds.next_fragment == 1 and w.round_quota == H for w in workers)
        assert all(w.fragment_rounds() == [0, 0] for w in workers)  # nothing applied yet
        tasks = [w.rounds.in_flight[1] for w in workers]
        await asyncio.gather(*tasks)
        averaged = tasks[0].result()[0][0].averaged
        assert all(torch.equal(t.result()[0][0].averaged, averaged) for t in tasks)
        deltas = [initial[0].theta - local for local in locals0]
        torch.testing.assert_close(averaged, sum(deltas) / 3, rtol=1e-5, atol=1e-7)
        # between two inner steps it lands: fragment 0's outer step, then its theta_local merges with it
        before = [w.parts[0].fragment.flatten(w.model) for w in workers]
        others = [w.parts[1].fragment.flatten(w.model) for w in workers]
        assert not any([await w.rounds.between_steps() for w in workers])
        reference = DelayedOuterStep(initial[0]).complete(averaged, hp)
        for w, local, other in zip(workers, before, others):
            assert w.rounds.in_flight is None and w.fragment_rounds() == [1, 0]
            assert w.parts[0].outer.digest() == reference.state.digest()
            assert torch.equal(w.parts[0].fragment.flatten(w.model), reference.merge(local, hp))
            assert torch.equal(w.parts[1].fragment.flatten(w.model), other)  # the other fragment untouched
        # fragment 1 closes the cycle: its round lands at the next fragment boundary at the latest
        for _ in range(2 * F - 1):
            for w in workers:
                await w.train_until_quota()
            await asyncio.gather(*[w.run_round() for w in workers])
        await asyncio.gather(*[w.rounds.in_flight[1] for w in workers])
        assert not any([await w.rounds.between_steps() for w in workers])
        assert all(w.fragment_rounds() == [2, 2] for w in workers)
        assert len({w.digest() for w in workers}) == 1
        assert all(w.stats.rounds_ok == 2 and w.stats.rounds_failed == 0 for w in workers)
        assert [e.outer_round for e in done] == [1, 2] and all(e.group_size == 3 for e in done)

    asyncio.run(main())


def test_a_failed_background_fragment_round_keeps_theta_outer_and_counts_its_samples_in_the_next_one(tmp_path):
    async def main():
        hub = Hub()
        a, b = (_worker(hub, name, _run(), tmp_path) for name in ("peer-a", "peer-b"))
        failed = []
        a.ctx.events.subscribe(lambda e: failed.append(e) if isinstance(e, RoundFailed) else None)
        await _start([a, b])
        fired = []
        real_run = b.syncs[0].allreduce.run

        async def failing_run(group, tensor, weight, out=None):
            if len(fired) < 2:  # both attempts of fragment 0's first round: the retry among the survivors would work
                fired.append(group.group_id)
                raise AllReduceFailed("injected")
            return await real_run(group, tensor, weight, out)

        b.syncs[0].allreduce.run = failing_run
        start = [p.outer.digest() for p in a.parts]
        for w in (a, b):
            await w.train_until_quota()
        await asyncio.gather(a.run_round(), b.run_round())
        await asyncio.gather(*[w.rounds.in_flight[1] for w in (a, b)])
        assert not any([await w.rounds.between_steps() for w in (a, b)])
        assert len(fired) == 2 and failed and "fragment 0" in failed[0].reason
        assert [p.outer.digest() for p in a.parts] == [p.outer.digest() for p in b.parts] == start
        assert a.fragment_rounds() == b.fragment_rounds() == [0, 0]
        # a cycle later fragment 0 is sent again with every step since its theta_outer last moved
        for _ in range(F):
            for w in (a, b):
                await w.train_until_quota()
            await asyncio.gather(a.run_round(), b.run_round())
        (outcome, weight, steps, _, _), _ = await asyncio.gather(*[w.rounds.in_flight[1] for w in (a, b)])
        assert a.rounds.in_flight[0] == 0 and isinstance(outcome, tuple)
        assert steps == H + H // F and weight == 4.0 * steps  # the failed round's steps counted in this one
        assert not any([await w.rounds.between_steps() for w in (a, b)])
        assert a.fragment_rounds()[0] == b.fragment_rounds()[0] == 1
        assert a.parts[0].outer.digest() == b.parts[0].outer.digest() != start[0]

    asyncio.run(main())


def test_workers_run_to_max_rounds_end_on_theta_outer_and_resume_from_the_last_checkpoint(tmp_path):
    async def main():
        hub = Hub()
        workers = [_worker(hub, f"peer-{c}", _run(max_outer_rounds=2), tmp_path) for c in "ab"]
        await asyncio.gather(*[w.run() for w in workers])
        for w in workers:
            assert w.fragment_rounds() == [2, 2] and w.rounds.in_flight is None  # drained, not overshooting
            assert w.stats.rounds_ok == 2 and w.stats.rounds_failed == 0
            for part in w.parts:  # the model kept is theta_outer
                assert torch.equal(part.fragment.flatten(w.model), part.outer.theta)
        assert workers[0].digest() == workers[1].digest()
        again = _worker(Hub(), "peer-a", _run(max_outer_rounds=2), tmp_path)  # peer-a's checkpoint dir
        again.resume()
        assert again.digest() == workers[0].digest() and again.fragment_rounds() == [2, 2]

    asyncio.run(main())
