"""Starting many light peers in one process (peerd.testing.avgpeer, peerd.transport.light) when the bootstrap node
answers some of them too late: as in the 32-peer matchmaking scenario on a loaded CI machine, where one peer's p2pd
exited with "failed to connect to bootstrap peers" and took its whole process down, leaving its 7 other daemons to a
closed event loop."""

import argparse
import asyncio
import functools

import pytest

from peerd.testing import avgpeer
from peerd.transport.factory import retry_unreachable
from peerd.transport.hivemind_backend import BootstrapUnreachable, dht_start_error
from peerd.transport.light import LightTransport

pytestmark = pytest.mark.timeout(60)

# nothing listens on port 9 of 127.0.0.1 (the discard port): a dial is refused at once
PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWBtPz6XL3brK5mWeGxqXyUL4BxTNkRTntktMeg3eCo6LZ"


def test_a_light_peer_whose_initial_peer_does_not_answer_raises_a_bootstrap_failure():
    """p2pd's own "failed to connect to bootstrap peers" is the error worth another try, not a plain ConnectionError."""
    with pytest.raises(BootstrapUnreachable, match="none of the 1 initial peer"):
        asyncio.run(LightTransport.create(initial_peers=[PEER], startup_timeout_s=20))


class _Peer:
    def __init__(self, name: str):
        self.name, self.stopped = name, 0

    async def shutdown(self) -> None:
        self.stopped += 1


def _args(peers: int) -> argparse.Namespace:
    return argparse.Namespace(light=True, peers=peers, index=0, initial_peers=[PEER], out="/dev/null")


def _starts(monkeypatch, outcomes: list[list]) -> list[_Peer]:
    """LightTransport.create answers each call with the next of ``outcomes[i]`` for the i-th peer started (an
    exception is raised); the light peers' runs are recorded, not run. Returns the record of runs."""
    calls = iter(range(len(outcomes)))
    started: dict[int, list] = {}

    async def create(**options):
        task = asyncio.current_task()
        if task not in started:  # one task per peer: its retries come back to the same list
            started[task] = list(outcomes[next(calls)])
        outcome = started[task].pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    ran: list[_Peer] = []

    async def run_peer(args, index, path, network):
        ran.append(network)

    monkeypatch.setattr(avgpeer.LightTransport, "create", staticmethod(create))
    monkeypatch.setattr(avgpeer, "run_peer", run_peer)
    monkeypatch.setattr(avgpeer, "retry_unreachable", functools.partial(retry_unreachable, retry_s=(0.01, 0.01)))
    return ran


def test_a_light_peer_answered_too_late_tries_again_and_every_peer_runs(monkeypatch):
    late = dht_start_error(RuntimeError("Daemon failed to start: failed to connect to bootstrap peers"), [PEER])
    peers = [_Peer(f"p{i}") for i in range(3)]
    ran = _starts(monkeypatch, [[peers[0]], [late, late, peers[1]], [peers[2]]])
    asyncio.run(avgpeer.run(_args(3)))
    assert sorted(p.name for p in ran) == ["p0", "p1", "p2"]  # p1 on its third try
    assert all(p.stopped == 0 for p in peers)


def test_a_light_peer_that_cannot_start_stops_the_daemons_already_started(monkeypatch):
    late = dht_start_error(RuntimeError("Daemon failed to start: failed to connect to bootstrap peers"), [PEER])
    peers = [_Peer(f"p{i}") for i in range(2)]
    ran = _starts(monkeypatch, [[peers[0]], [late, late, late], [peers[1]]])
    with pytest.raises(BootstrapUnreachable):
        asyncio.run(avgpeer.run(_args(3)))
    assert ran == [] and [p.stopped for p in peers] == [1, 1]
