"""A reducer's stream closes only after the member closed its own (p2pd drops buffered bytes on the other order).

The wait lives in the transport (peerd.transport.linger, used by the p2pd and direct streams); in-process, handlers
end as soon as the members close after reading their answers.
"""

import asyncio

import pytest
import torch

from peerd.transport.inprocess import Hub
from peerd.transport.linger import serve_stream, until_remote_closes
from protocols.allreduce import AllReduceConfig
from protocols.matchmaking import MatchmakingConfig

pytestmark = pytest.mark.timeout(60)


def test_waits_for_the_member_to_close_and_no_longer_than_the_timeout():
    async def main():
        reader = asyncio.StreamReader()
        waiting = asyncio.ensure_future(until_remote_closes(reader, 5.0))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # the member has not closed: our side stays open
        reader.feed_eof()
        await asyncio.wait_for(waiting, 1.0)
        started = asyncio.get_running_loop().time()
        await until_remote_closes(asyncio.StreamReader(), 0.2)  # a member that never closes
        return asyncio.get_running_loop().time() - started

    assert 0.15 <= asyncio.run(main()) < 1.0


def test_a_served_stream_lingers_after_an_answer_and_not_after_a_failed_handler(caplog):
    """serve_stream: the one handler boundary of the p2pd and direct transports."""

    async def answers(peer, reader, writer):
        pass

    async def fails(peer, reader, writer):
        raise KeyError("a handler bug")

    async def main():
        reader = asyncio.StreamReader()
        lingering = asyncio.ensure_future(serve_stream(answers, "peerA", reader, None, "answers"))
        await asyncio.sleep(0.05)
        assert not lingering.done()  # answered: waits for the remote's close
        reader.feed_eof()
        await asyncio.wait_for(lingering, 1.0)
        await asyncio.wait_for(serve_stream(fails, "peerB", asyncio.StreamReader(), None, "fails"), 1.0)

    with caplog.at_level("ERROR", logger="peerd.transport.linger"):
        asyncio.run(main())
    assert [(r.getMessage(), type(r.exc_info[1])) for r in caplog.records] == [
        ("stream handler fails failed for peerB", KeyError)]


def test_reducer_handlers_end_once_members_close_after_reading_the_answer(averaging_peers):
    cfg = AllReduceConfig(compression="none", sender_timeout_s=5.0, reducer_timeout_s=10.0)

    async def main():
        hub = Hub()
        peers = await averaging_peers(hub, ("a", "b", "c"), "run", MatchmakingConfig(3.0, 1.0, 0.05), cfg)

        async def member(i):
            mm, ar = peers[i]
            group = await mm.form_group("r0", {}, expected_size=3)
            return await ar.run(group, torch.full((999,), float(i)), 1.0)

        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(member(i) for i in range(3)))
        await asyncio.sleep(0.1)
        pending = sum(1 for p in peers for task in p.transport.streams._tasks if not task.done())
        return results, pending, asyncio.get_running_loop().time() - started

    results, pending, seconds = asyncio.run(main())
    for r in results:
        assert torch.equal(r.averaged, torch.full((999,), 1.0))
    assert pending == 0  # every member closed after reading: no handler waited out sender_timeout_s
    assert seconds < cfg.sender_timeout_s
