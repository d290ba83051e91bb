"""DiLoCo all-reduce rounds when the workers' views of the swarm differ (in-process transport): status records
missing from one worker's view, as on a loaded DHT, no longer seal a round without a peer that others know of, nor
leave a peer that came late to the round training on a stale state."""

import asyncio

import pytest

from peerd.config import NodeConfig
from peerd.roles.base import RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.worker.catch_up import steps_done_now
from peerd.roles.outer_sync import RETRIES_FIELD
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams

pytestmark = pytest.mark.timeout(90)

NAMES = ("peer-a", "peer-b", "peer-c")  # peer-a has the smallest PeerID: it leads every group


def _workers(tmp_path) -> list[DiLoCoRole]:
    run = RunConfig(
        model="tiny", seq_len=32, batch_size=4, eval_batches=0,
        diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=2, inner_lr=1e-3),
        averaging=AveragingConfig.from_flat(matchmaking_timeout_s=4.0, request_timeout_s=1.0, sender_timeout_s=3.0,
                                            reducer_timeout_s=6.0),
    )
    hub = Hub()
    return [DiLoCoRole(RunContext.build("unit", run, NodeConfig(checkpoint_dir=str(tmp_path / name), threads=1,
                                                                device="cpu"), hub.transport(name)))
            for name in NAMES]


def _hide(worker: DiLoCoRole, *peers: str) -> list[int]:
    """``worker``'s reads of the status records lack ``peers``' records from now on; returns the count of reads that
    dropped one (proof the fault fired)."""
    real, hidden = worker.peer_records, []

    async def records():
        out = await real()
        if any(out.pop(p, None) is not None for p in peers):
            hidden.append(1)
        return out

    worker.peer_records = records
    return hidden


async def _start(workers):
    for w in workers:
        for component in w.components:
            await component.start()
        await w.publish_status()


async def _round(workers, late, delay_s, after: "asyncio.Event | None" = None):
    """Every worker trains its quota and runs its outer round; ``late`` reaches the boundary ``delay_s`` later (or
    once ``after`` is set)."""
    for w in workers:
        await w.train_until_quota()

    async def boundary(w):
        if w is late:
            await (after.wait() if after is not None else asyncio.sleep(delay_s))
        await w.run_round()

    await asyncio.gather(*(boundary(w) for w in workers))


def test_the_leader_waits_for_a_peer_its_own_view_lacks_but_a_followers_view_has(tmp_path):
    """peer-a's view lacks peer-c: alone it expected 2 and sealed when peer-b came, and peer-c, 0.5 s later, was left
    out. peer-b's view has peer-c and it says so when it joins: the group waits and all three average."""
    async def main():
        a, b, c = workers = _workers(tmp_path)
        await _start(workers)
        hidden = _hide(a, "peer-c")
        await _round(workers, late=c, delay_s=0.5)
        return workers, hidden

    workers, hidden = asyncio.run(main())
    assert hidden  # the leader's view did lack peer-c
    assert [w.outer.outer_round for w in workers] == [1, 1, 1]
    assert len({w.outer.digest() for w in workers}) == 1
    assert all(w.stats.rounds_ok == 1 and w.stats.rounds_failed == 0 for w in workers)


def test_a_peer_left_out_adopts_the_rounds_state_though_its_view_lacks_the_leader(tmp_path):
    """Neither peer-a's nor peer-b's view has peer-c, which comes late, while their all-reduce runs: the group
    sealed without it and peer-c is told so. Its own view lacks the leader's record: it used to stop waiting for the
    leader's round at once, find nobody ahead yet, fail the round and train the next on the stale state. It now waits
    until a live worker (peer-b) has finished the round, adopts that state, and counts no failed try (no fresh group
    key for the latecomers)."""
    async def main():
        a, b, c = workers = _workers(tmp_path)
        await _start(workers)
        hidden = [_hide(a, "peer-c"), _hide(b, "peer-c"), _hide(c, "peer-a")]
        sealed = asyncio.Event()  # peer-c comes once a's and b's group has sealed (on a loaded machine 0.3 s late
        for w in (a, b):          # could still be in time): an all-reduce that takes a while (64 workers: ~20 s)
            real_run = w.sync.allreduce.run

            async def slow_run(group, tensor, weight, out=None, real_run=real_run):
                sealed.set()
                await asyncio.sleep(1.0)
                return await real_run(group, tensor, weight, out)

            w.sync.allreduce.run = slow_run
        await _round(workers, late=c, delay_s=0.3, after=sealed)
        return workers, hidden

    (a, b, c), hidden = asyncio.run(main())
    assert all(hidden)
    assert a.stats.rounds_ok == b.stats.rounds_ok == 1
    assert c.stats.rounds_ok == 0 and c.stats.rounds_failed == 1  # left out of round 1 ...
    assert [w.outer.outer_round for w in (a, b, c)] == [1, 1, 1]  # ... and adopted its state
    assert c.outer.digest() == a.outer.digest() == b.outer.digest()
    assert RETRIES_FIELD not in c.status_fields()


def test_a_joiner_counts_the_steps_a_peer_took_since_its_status_record_was_published():
    """A record published 60 s ago at step 3, at 128 tokens/s with 256 tokens a step: the peer is at step 33 now,
    capped at the round's 20 (the joiner then trains 1 step, not 17); the first ``fresh_s`` of its age (the
    publication interval) count no steps; no rate or a record from the future: as published."""
    record = {"inner_step": 3, "tokens_per_s": 128.0, "time": 1000.0}
    assert steps_done_now(record, 1010.0, 256, 20) == 8
    assert steps_done_now(record, 1010.0, 256, 20, fresh_s=5.0) == 5
    assert steps_done_now(record, 1004.0, 256, 20, fresh_s=5.0) == 3
    assert steps_done_now(record, 1060.0, 256, 20) == 20
    assert steps_done_now({**record, "tokens_per_s": None}, 1060.0, 256, 20) == 3
    assert steps_done_now(record, 990.0, 256, 20) == 3
    assert steps_done_now({"inner_step": None, "tokens_per_s": 0.0, "time": 1000.0}, 1060.0, 256, 20) == 0


def test_a_worker_whose_theta_outer_only_a_minority_holds_adopts_the_majority_s_at_the_same_round(tmp_path):
    """After one round of all three, peer-c's theta_outer is made to differ (a group of one round that sealed apart
    from the others', a fork under the same round number). At its next boundary peer-c sees 2 workers at its round
    with another digest against its 1 and downloads their state; peer-a, holding the majority's, downloads nothing."""
    from protocols.diloco import OuterState

    async def main():
        a, b, c = workers = _workers(tmp_path)
        await _start(workers)
        await _round(workers, late=None, delay_s=0)
        majority = a.outer.digest()
        c.outer = OuterState(c.outer.theta + 1e-3, c.outer.momentum.clone(), c.outer.outer_round)
        await c.publish_status()
        forked = c.outer.digest()
        live = await a.live_peers()
        assert not await a.catch_up(live, 1, heal_fork=True)  # the majority keeps its state
        assert await c.catch_up(await c.live_peers(), 1, heal_fork=True)
        return workers, majority, forked

    (a, b, c), majority, forked = asyncio.run(main())
    assert forked != majority
    assert a.outer.digest() == b.outer.digest() == c.outer.digest() == majority
    assert [w.outer.outer_round for w in (a, b, c)] == [1, 1, 1]
