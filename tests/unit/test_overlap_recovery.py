"""Delayed-overlap DiLoCo rounds under the two faults of a loaded WAN run (in-process transport): a leader whose view
lacks a peer's lapsed status record, and a failed round tried again while its former leader is still training; and a
worker whose theta_outer forked from the others' at the same round."""

import asyncio

import pytest

from peerd.config import NodeConfig
from peerd.roles.base import RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.worker.rounds.base import RoundEnd
from peerd.roles.outer_sync import RETRIES_FIELD, RoundFailure, agreed_retry, group_key
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceFailed
from protocols.diloco import DiLoCoHyperparams

pytestmark = pytest.mark.timeout(90)

NAMES = ("peer-a", "peer-b", "peer-c")  # peer-a has the smallest PeerID: it leads every group


def _workers(tmp_path, min_group_size=3) -> list[DiLoCoRole]:
    run = RunConfig(
        model="tiny", seq_len=32, batch_size=4, eval_batches=0,
        diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=2, inner_lr=1e-3, overlap="delayed"),
        averaging=AveragingConfig.from_flat(min_group_size=min_group_size, matchmaking_timeout_s=4.0, request_timeout_s=1.0,
                                            sender_timeout_s=3.0, reducer_timeout_s=6.0),
    )
    hub = Hub()
    return [DiLoCoRole(RunContext.build("unit", run, NodeConfig(checkpoint_dir=str(tmp_path / name), threads=1,
                                                                device="cpu"), hub.transport(name)))
            for name in NAMES]


async def _start(workers):
    for w in workers:
        for component in w.components:
            await component.start()
        await w.publish_status()


async def _boundary(workers, late=(), delay_s=0.0):
    """Every worker trains its quota and reaches the round boundary; the ``late`` ones ``delay_s`` after the rest."""
    for w in workers:
        await w.train_until_quota()
    await asyncio.gather(*[w.run_round() for w in workers if w not in late])
    if late:
        await asyncio.sleep(delay_s)
        await asyncio.gather(*[w.run_round() for w in late])


async def _settle(workers):
    """The outcomes of the background all-reduces now in flight."""
    return [(await w.rounds.in_flight)[0] for w in workers]


@pytest.mark.parametrize("min_group_size", [3, 1])
def test_a_lapsed_status_record_in_the_leaders_view_does_not_fail_the_round(min_group_size, tmp_path):
    """The leader read the live peers while one record had lapsed: it expected 2 of 3 and sealed the group at the
    second arrival. With min_group_size 3 that group failed every member's round (the WAN run's "only 3 peer(s)" /
    "already sealed"); with 1 the third failed alone and had to download the state. Now the group waits for the
    third (below min_group_size; a member of the last group without a record), which comes 0.5 s later."""
    async def main():
        a, b, c = workers = _workers(tmp_path, min_group_size)
        await _start(workers)
        await _boundary(workers)  # launches round 0
        dropped = []
        real_records = a.peer_records

        async def lapsed_records():
            records = await real_records()
            if not dropped and a.outer.outer_round == 1:
                dropped.append(records.pop("peer-c"))
            return records

        a.peer_records = lapsed_records
        await _boundary(workers, late=(c,), delay_s=0.5)  # lands round 0, launches round 1
        outcomes = await _settle(workers)
        assert len(dropped) == 1
        assert all(isinstance(o, tuple) and o[0].group_size == 3 for o in outcomes), outcomes
        await _boundary(workers)  # lands round 1
        assert [w.outer.outer_round for w in workers] == [2, 2, 2]
        assert len({w.outer.digest() for w in workers}) == 1
        assert all(w.stats.rounds_failed == 0 and w.stats.rounds_ok == 2 for w in workers)
        for w in workers:
            w.rounds.drop()

    asyncio.run(main())


def test_a_failed_round_is_tried_again_under_a_fresh_key_while_its_former_leader_is_late(tmp_path):
    """Round 1 fails on every peer (its all-reduce fails twice). At the next boundary the leader comes last: under the
    old key the others met its remembered seal of that key ("already sealed", or the failed group again) and failed
    once more; a fresh key per try lets them wait for it. theta_outer stays unchanged across the failure and the
    failed round's steps are carried into the try that succeeds."""
    async def main():
        a, b, c = workers = _workers(tmp_path)
        await _start(workers)
        injected = {w.peer_id: 0 for w in workers}
        for w in workers:
            real_run = w.sync.allreduce.run

            async def failing_run(group, tensor, weight, out=None, real_run=real_run, peer=w.peer_id):
                if group.key in (group_key(1), group_key(1, attempt=2)) and injected[peer] < 2:
                    injected[peer] += 1
                    raise AllReduceFailed("injected")
                return await real_run(group, tensor, weight, out)

            w.sync.allreduce.run = failing_run
        await _boundary(workers)  # launches round 0
        await _boundary(workers)  # lands round 0, launches round 1 (it will fail)
        assert all(isinstance(o, RoundFailure) for o in await _settle(workers))
        assert injected == {w.peer_id: 2 for w in workers}
        theta = a.outer.digest()
        assert all(w.status_fields()[RETRIES_FIELD] == {"model": [1, 1]} for w in workers)
        await _boundary(workers, late=(a,), delay_s=1.0)  # lands the failure, tries round 1 again
        assert all(w.outer.digest() == theta and w.stats.rounds_failed == 1 for w in workers)
        outcomes = await _settle(workers)
        assert all(isinstance(o, tuple) and o[0].group_size == 3 for o in outcomes), outcomes
        assert all(group_key(1, retry=1) in w.sync.matchmaker._sealed_keys for w in workers)
        weights = [w.rounds.in_flight.result()[2] for w in workers]
        assert weights == [24.0, 24.0, 24.0]  # both rounds' samples: 2 x 3 steps x 4 sequences
        await _boundary(workers)  # lands it
        assert [w.outer.outer_round for w in workers] == [2, 2, 2]
        assert len({w.outer.digest() for w in workers}) == 1 and a.outer.digest() != theta
        assert all(RETRIES_FIELD not in w.status_fields() for w in workers)
        for w in workers:
            w.rounds.drop()

    asyncio.run(main())


def test_group_keys_and_the_agreed_try_of_a_round():
    # the round after version 3 is round 4 in the logs, and in its keys
    assert group_key(3) == "round4" and group_key(3, attempt=2) == "round4.attempt2"  # a first try
    assert group_key(3, retry=2) == "round4.retry2" and group_key(3, 1, 2) == "round4.retry1.attempt2"
    assert group_key(0) == "round1"
    live = {
        "p1": {RETRIES_FIELD: {"model": [3, 2]}},  # failed round 3 twice: a peer that missed a try catches up
        "p2": {RETRIES_FIELD: {"model": [2, 7]}},  # counts of an earlier round do not matter
        "p3": {RETRIES_FIELD: {"f0": [3, 5]}},  # nor another fragment's
        "p4": {RETRIES_FIELD: None},
        "p5": {RETRIES_FIELD: {"model": [3, 10**9]}},  # not a real count: ignored
        "p6": {RETRIES_FIELD: {"model": "x"}},
    }
    assert agreed_retry(3, 0, "model", live) == 2
    assert agreed_retry(3, 4, "model", live) == 4
    assert agreed_retry(3, 0, "f0", live) == 5
    assert agreed_retry(4, 0, "model", live) == 0
    assert agreed_retry(3, 1, "model", {}) == 1


def test_a_forked_worker_adopts_the_majority_s_theta_outer_at_its_delayed_boundary(tmp_path):
    """After a round all three landed, peer-c's theta_outer is made to differ at the same outer round (a fork): at
    its next boundary with the delayed overlap it sees two workers at its round holding another digest and adopts
    their state instead of launching an exchange nobody else's theta_outer matches."""
    from protocols.diloco import OuterState

    async def main():
        a, b, c = workers = _workers(tmp_path)
        await _start(workers)
        await _boundary(workers)  # launches round 0
        await _boundary(workers)  # lands round 0, launches round 1
        await _settle(workers)
        for w in workers:
            w.rounds.drop()
        majority = a.outer.digest()
        c.outer = OuterState(c.outer.theta + 1e-3, c.outer.momentum.clone(), c.outer.outer_round)
        await c.publish_status()
        forked = c.outer.digest()
        await c.train_until_quota()
        await c.run_round()
        return workers, majority, forked

    (a, b, c), majority, forked = asyncio.run(main())
    assert forked != majority
    assert c.outer.digest() == majority and c.rounds.in_flight is None  # adopted, no exchange launched
    assert [w.outer.outer_round for w in (a, b, c)] == [1, 1, 1]


@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_a_worker_whose_fragment_forked_adopts_the_majority_s_state_at_that_fragment_s_boundary(overlap, tmp_path):
    """Fragments (F = 2): after the first cycle peer-c's fragment 0 is made to differ at the same fragment round (a
    fork of that fragment only; its whole-model digest differs too, but fragment rounds do not compare that): at
    fragment 0's next boundary it sees two workers at its fragment round holding another fragment digest and adopts
    their state, so that every later round of that fragment averages states the members share."""
    from protocols.diloco import OuterState

    async def main():
        run = RunConfig(
            model="tiny", seq_len=32, batch_size=4, eval_batches=0,
            diloco=DiLoCoHyperparams(inner_steps=4, warmup_steps=2, inner_lr=1e-3, fragments=2, overlap=overlap),
            averaging=AveragingConfig.from_flat(min_group_size=3, matchmaking_timeout_s=4.0, request_timeout_s=1.0,
                                                sender_timeout_s=3.0, reducer_timeout_s=6.0))
        hub = Hub()
        workers = [DiLoCoRole(RunContext.build("unit", run, NodeConfig(checkpoint_dir=str(tmp_path / name),
                                                                       threads=1, device="cpu"),
                                               hub.transport(name))) for name in NAMES]
        a, b, c = workers
        await _start(workers)
        for _ in range(2):  # fragment 0's round, then fragment 1's: one cycle
            await _boundary(workers)
        if overlap == "delayed":
            for w in workers:
                await w.rounds.land()
        assert [w.fragment_rounds() for w in workers] == [[1, 1]] * 3
        majority = a.parts[0].outer.digest()
        forked = c.parts[0].outer
        c.parts[0].outer = OuterState(forked.theta + 1e-3, forked.momentum.clone(), forked.outer_round)
        await c.publish_status()
        await c.train_until_quota()
        ended = await c.run_round()
        return workers, majority, c.parts[0].outer.digest(), ended

    (a, b, c), majority, healed, ended = asyncio.run(main())
    assert healed == majority  # fragment 0 holds the majority's theta_outer again
    assert ended == RoundEnd.ADOPTED
    assert c.fragment_rounds() == [1, 1]
