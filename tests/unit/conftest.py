"""Fixtures of the in-process tests: averaging peers (matchmaker + butterfly all-reduce) on a :class:`Hub`, and both
orders in which asyncio's ``wait_for`` schedules (Python 3.11's and 3.12's)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import pytest

from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceConfig, ButterflyAllReduce
from protocols.bans import BanList
from protocols.matchmaking import MatchmakingConfig, Matchmaker

#: Short timeouts for in-process peers (seconds): nothing here waits on a real network.
FAST_MATCHMAKING = MatchmakingConfig(matchmaking_timeout_s=3.0, request_timeout_s=1.0, poll_interval_s=0.05)
FAST_ALLREDUCE = AllReduceConfig(compression="none", sender_timeout_s=1.0, reducer_timeout_s=2.0)


@dataclass
class AveragingPeer:
    """One in-process peer: its transport, matchmaker and all-reduce (started), and its ban list if it has one.
    Unpacks as ``mm, ar = peer``."""

    transport: Any
    matchmaker: Matchmaker
    allreduce: ButterflyAllReduce
    bans: Optional[BanList] = None

    def __iter__(self):
        return iter((self.matchmaker, self.allreduce))

    async def round(self, key: str, x, weight: float, expected: Optional[int] = None, info: Optional[dict] = None,
                    **run: Any):
        """Form the group of ``key`` and all-reduce ``x`` with ``weight`` in it (``run``: more arguments of the
        all-reduce's ``run``, e.g. ``out``)."""
        group = await self.matchmaker.form_group(key, info or {}, expected_size=expected)
        return await self.allreduce.run(group, x, weight, **run)


async def start_averaging_peers(
    hub: Hub,
    peers: Union[int, Iterable[str]],
    prefix: str = "run",
    matchmaking: MatchmakingConfig = FAST_MATCHMAKING,
    allreduce: AllReduceConfig = FAST_ALLREDUCE,
    *,
    admit: Optional[Callable] = None,
    ban_s: Optional[float] = None,
    allreduce_class: Union[type, Callable[[int], type]] = ButterflyAllReduce,
    wrap: Optional[Callable[[int, Any], Any]] = None,
) -> list[AveragingPeer]:
    """Start ``peers`` (a count, named ``peer00``..., or names) with a matchmaker and an all-reduce under ``prefix``.

    ``ban_s``: give each peer a :class:`BanList` shared by both services. ``allreduce_class``: a class, or
    ``index -> class``. ``wrap(index, transport)``: e.g. a fault-injecting wrapper for one peer.
    """
    names = [f"peer{i:02d}" for i in range(peers)] if isinstance(peers, int) else list(peers)
    out = []
    for i, name in enumerate(names):
        transport = hub.transport(name)
        if wrap is not None:
            transport = wrap(i, transport)
        bans = BanList(ban_s) if ban_s is not None else None
        cls = allreduce_class if isinstance(allreduce_class, type) else allreduce_class(i)
        extra = {"bans": bans} if bans is not None else {}
        mm = Matchmaker(transport, prefix, matchmaking, admit=admit, **extra)
        ar = cls(transport, prefix, allreduce, **extra)
        await mm.start()
        await ar.start()
        out.append(AveragingPeer(transport, mm, ar, bans))
    return out


@pytest.fixture
def averaging_peers():
    """``await averaging_peers(hub, n, prefix, matchmaking_config, allreduce_config, ...)``: see
    :func:`start_averaging_peers`."""
    return start_averaging_peers


async def _wait_for_in_caller_task(aw, timeout):
    """``asyncio.wait_for`` as Python 3.12 runs it: the awaitable runs inside the caller's task under a timeout
    scope, with no task of its own, so the caller resumes event-loop turns earlier than under 3.11."""
    if timeout is None:
        return await aw
    async with asyncio.timeout(timeout):
        return await aw


@pytest.fixture(params=["this_python", "py312_wait_for"])
def wait_for_order(request, monkeypatch) -> str:
    """Run the test under this interpreter's ``asyncio.wait_for`` and under Python 3.12's, whichever runs here.

    The order in which coroutines finish differs between the two: under 3.12 a client that read a reply can run on
    before the handler that wrote it has resumed (an in-process hub). Tests that passed under 3.11 alone failed on a
    machine with Python 3.12: a counter updated after an await lost updates, a counter read before the handler that
    bumps it resumed. Every in-process module looks ``asyncio.wait_for`` up at call time, so patching it is enough.
    """
    if request.param == "py312_wait_for":
        if not hasattr(asyncio, "timeout"):
            pytest.skip("asyncio.timeout (Python 3.11+) is needed to run 3.12's wait_for order")
        monkeypatch.setattr(asyncio, "wait_for", _wait_for_in_caller_task)
    return request.param


@pytest.fixture
def corpus_file(tmp_path) -> str:
    """A small text corpus (1,500 lines, ~72 KB) in ``tmp_path / "corpus.txt"``; returns its path."""
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"Line {i}: now is the winter of our discontent.\n" for i in range(1500)))
    return str(path)
