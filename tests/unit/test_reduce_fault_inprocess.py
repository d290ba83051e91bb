"""The ``reduce`` kill of peerd.testing.faults on in-process peers: the reducer dies with its part sealed, before answering."""

import asyncio

import pytest
import torch

from peerd.testing.faults import Faults, FaultyTransport
from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceFailed
from protocols.wire import write_frame

pytestmark = pytest.mark.timeout(60)

class _Sink:
    def __init__(self):
        self.data = b""

    def write(self, data):
        self.data += bytes(data)

    async def drain(self):
        pass

    def close(self):
        pass


def test_reduce_kill_fires_before_the_first_byte_of_an_answer_and_passes_refusals():
    killed = []
    faults = Faults(on_kill=lambda: killed.append(True)).kill(at_round=1, phase="reduce")
    faults.round = 1
    seen = []

    async def handler(peer, reader, writer):
        seen.append(peer)
        await write_frame(writer, {"status": "refused", "reason": "x"})  # passes through
        await write_frame(writer, {"status": "ok"}, b"\0" * 16)  # the averaged part: dies first

    async def main():
        wrapped = faults.wrap_handler(handler, "run.reduce")
        sink = _Sink()
        with pytest.raises(ConnectionResetError):
            await wrapped("peerA", None, sink)
        return sink

    sink = asyncio.run(main())
    assert killed == [True] and faults.fired["kill"] == 1 and seen == ["peerA"]
    assert b"refused" in sink.data and b"ok" not in sink.data  # not a byte of the answer left
    faults.round = 2
    assert faults.wrap_handler(handler, "run.matchmaking") is handler


@pytest.mark.parametrize("victim", [0, 2])
def test_dead_reducer_fails_the_attempt_for_everyone_and_the_retry_averages_the_survivors(victim, averaging_peers):
    n, numel = 4, 1000
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(n)]

    async def main():
        hub = Hub()
        names = [f"peer{i:02d}" for i in range(n)]
        faults = Faults(on_kill=lambda: hub.disconnect(names[victim])).kill(at_round=1, phase="reduce")
        faults.round = 1
        peers = await averaging_peers(hub, names,
                                      wrap=lambda i, t: FaultyTransport.wrap(t, faults) if i == victim else t)

        async def member(i):
            mm, ar = peers[i]
            group = await mm.form_group("r0", {}, expected_size=n)
            try:
                return await ar.run(group, xs[i], 1.0)
            except AllReduceFailed as e:
                if i == victim:
                    return e
            group = await mm.form_group("r0.attempt2", {}, expected_size=n - 1)  # retry among the survivors
            return await ar.run(group, xs[i], 1.0)

        return faults, await asyncio.gather(*(member(i) for i in range(n)))

    faults, results = asyncio.run(main())
    assert faults.fired["kill"] == 1
    assert isinstance(results[victim], AllReduceFailed)
    survivors = [i for i in range(n) if i != victim]
    reference = torch.stack([xs[i] for i in survivors]).mean(0)
    for i in survivors:
        assert results[i].group_size == n - 1
        torch.testing.assert_close(results[i].averaged, reference, rtol=0, atol=1e-6)
        assert torch.equal(results[i].averaged, results[survivors[0]].averaged)
