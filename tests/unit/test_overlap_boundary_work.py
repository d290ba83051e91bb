"""What the overlapped strategies keep off the inner steps' critical path: status records go out in the background
(one at a time, the newest last, finished before leaving), the outer step of a finished exchange and its digest are
computed off the event loop, and a state's digest is hashed once."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from peerd.worker.rounds.base import LandsInFlight, RoundStrategy
from protocols.allreduce import AllReduceResult
from protocols.diloco import DelayedOuterStep, DiLoCoHyperparams, OuterState

pytestmark = pytest.mark.timeout(30)


class SlowBoard:
    """A status board whose every store waits for ``release``; ``stored`` records the version stored."""

    def __init__(self):
        self.version = 0
        self.stored: list[int] = []
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def publish(self):
        version = self.version  # the record is built when the store starts
        self.started.set()
        await self.release.wait()
        self.stored.append(version)


class Strategy(LandsInFlight, RoundStrategy):
    def __init__(self, worker):  # no parts: only the mixin's machinery is under test
        self.worker = worker
        self.in_flight = None


def _strategy(board=None):
    worker = SimpleNamespace(ctx=SimpleNamespace(status=board), hp=DiLoCoHyperparams(inner_steps=2))
    return Strategy(worker)


def test_records_go_out_in_the_background_one_at_a_time_and_the_newest_last():
    async def main():
        board = SlowBoard()
        s = _strategy(board)
        s.publish_soon()  # returns at once: nothing waits for the store
        await board.started.wait()
        for v in (1, 2, 3):  # three changes while the first store runs: one more store, of the newest
            board.version = v
            await s.publish_status()
        assert board.stored == []
        board.release.set()
        await s.close()  # leaving waits for the stores, so a "left" record published after it is the last word
        assert board.stored == [0, 3]

    asyncio.run(main())


def test_the_outer_step_of_a_finished_exchange_is_computed_off_the_loop_and_used_when_nothing_replaced_theta():
    async def main():
        s = _strategy()
        outer = OuterState.initial(torch.arange(8, dtype=torch.float32))
        averaged = torch.full((8,), 0.5)
        result = AllReduceResult(averaged, 2, 0, 0, 0.0, 2)
        loop_thread = asyncio.get_running_loop()
        stepped = await s.step_off_loop(outer, (result, 1))
        assert stepped[0] is outer
        expected = DelayedOuterStep(outer).complete(averaged, s.worker.hp)
        assert torch.equal(stepped[1].state.theta, expected.state.theta)
        assert stepped[1].state._digest is not None  # hashed in the worker thread, not on the loop
        assert s.landed_step(outer, stepped, averaged) is stepped[1]
        adopted = OuterState.initial(torch.ones(8))  # a download replaced theta_outer meanwhile: computed anew
        again = s.landed_step(adopted, stepped, averaged)
        assert torch.equal(again.state.theta, DelayedOuterStep(adopted).complete(averaged, s.worker.hp).state.theta)
        assert await s.step_off_loop(outer, None) is None  # a failure or a stop: nothing to step
        assert loop_thread is asyncio.get_running_loop()

    asyncio.run(main())


def test_a_state_s_digest_is_hashed_once_and_equals_a_fresh_hash():
    theta = torch.randn(1000)
    state = OuterState(theta.clone(), torch.zeros(1000), 3)
    first = state.digest()
    assert state.digest() is first  # kept, not hashed again
    assert OuterState(theta.clone(), torch.zeros(1000), 3).digest() == first
    assert OuterState(theta.clone(), torch.zeros(1000), 4).digest() != first
