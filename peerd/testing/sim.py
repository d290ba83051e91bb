"""A swarm simulator: thousands of peers running the real protocol code on the in-process transport, in virtual time.

Every peer is the same :class:`~protocols.matchmaking.Matchmaker`, :class:`~protocols.allreduce.ButterflyAllReduce`,
:class:`~protocols.moshpit.MoshpitAverager` or :class:`~protocols.gossip.GossipAverager` a real peer runs; only the
network and the clock are simulated:

- **Virtual time** (:class:`VirtualTimeLoop`): an asyncio event loop whose clock jumps to the next timer whenever
  nothing is ready to run, so a 30 s timeout costs no wall time and 10,000 peers' rounds take as long as their
  Python work, not as long as their waits. Discovery records expire on the same clock.
- **Links** (:class:`SimHub`): every directed byte stream is delayed by the link's latency plus its size over the
  link's bandwidth, in order. Per-pair latency and per-peer uplink bandwidth are drawn from log-normal
  distributions (:class:`LinkModel`), seeded, so a run is reproducible.
- **Churn**: :meth:`SimHub.disconnect` at a virtual time crashes a peer as other peers see it (its streams fail).

:func:`simulate_moshpit` and :func:`simulate_gossip` run N peers for a number of rounds and report per-round
success, group sizes, virtual round times and consensus distance. Used by ``scripts/bench_scale.py`` and the tests
that check the simulator against the pure cores (Moshpit: exact average after d rounds on a full grid, Ryabinin et
al. 2021, Sec. 3.1; gossip: squared consensus distance shrinking by the spectral-gap factor 1 - 1/(N-1) per
uniformly random pairwise exchange, Boyd et al. 2006, Sec. II).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import random
import selectors
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from peerd.transport.inprocess import Hub, InProcessDiscovery, InProcessStreams, InProcessTransport, PipeWriter
from protocols.allreduce import AllReduceConfig, AllReduceFailed, ButterflyAllReduce
from protocols.gossip import GossipAverager, GossipConfig
from protocols.matchmaking import MatchmakingConfig, Matchmaker, MatchmakingFailed
from protocols.moshpit import MoshpitAverager

#: Virtual clocks start here (a plausible Unix time, so discovery expirations look like real ones).
EPOCH = 1.7e9


# ------------------------------------------------------------------------------------------------------ virtual time


class _VirtualSelector(selectors.DefaultSelector):
    """A selector that never sleeps: a wait for ``timeout`` seconds advances the loop's virtual clock instead."""

    loop: "VirtualTimeLoop"

    def select(self, timeout: Optional[float] = None):
        events = super().select(0)
        if events:
            return events
        if timeout is None:
            raise RuntimeError("simulation stalled: nothing is ready and no timer is set")
        if timeout > 0:
            self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock (seconds): ``time()`` only moves when every task waits on a timer."""

    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds


def run_virtual(coro):
    """Run ``coro`` to completion on a fresh :class:`VirtualTimeLoop`; returns its result."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        # as asyncio.run does: cancel what is left (servers' handlers, watchers) and let it unwind on this loop
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


# ------------------------------------------------------------------------------------------------------------- links


@dataclass(frozen=True)
class LinkModel:
    """Per-link latency (one way, seconds) and per-peer uplink bandwidth (bytes/s), both log-normal.

    ``latency_median_s`` / ``bandwidth_median_Bps`` are the medians; ``*_sigma`` the standard deviations of the
    logarithms (0 = every link alike). Defaults: 30 ms median latency, 100 Mbit/s median uplink.
    """

    latency_median_s: float = 0.03
    latency_sigma: float = 0.5
    bandwidth_median_Bps: float = 12.5e6
    bandwidth_sigma: float = 0.5
    seed: int = 0

    def latency(self, a: str, b: str) -> float:
        lo, hi = sorted((a, b))
        return self.latency_median_s * math.exp(self.latency_sigma * _gauss(f"{self.seed}:lat:{lo}:{hi}"))

    def uplink(self, peer: str) -> float:
        return self.bandwidth_median_Bps * math.exp(self.bandwidth_sigma * _gauss(f"{self.seed}:bw:{peer}"))


def _gauss(name: str) -> float:
    return random.Random(hashlib.sha256(name.encode()).digest()).gauss(0.0, 1.0)


class _LinkWriter(PipeWriter):
    """One direction of a simulated stream: bytes arrive ``latency + size / bandwidth`` later, in order."""

    def __init__(self, target: asyncio.StreamReader, hub: "SimHub", owner: str, remote: str):
        super().__init__(target, hub, owner, remote)
        self._latency = hub.latency(owner, remote)
        self._bandwidth = min(hub.uplink(owner), hub.uplink(remote))
        self._wire_free = 0.0  # virtual time at which the last byte queued so far has left the sender
        self._in_flight: collections.deque = collections.deque()  # (arrival time, bytes or None for the end)

    def _deliver_at(self, size: int) -> float:
        loop = asyncio.get_running_loop()
        self._wire_free = max(loop.time(), self._wire_free) + size / self._bandwidth
        return self._wire_free + self._latency

    def write(self, data: bytes) -> None:
        if self._closed or not self._hub.connected(self._owner, self._remote):
            raise ConnectionResetError(f"stream {self._owner} -> {self._remote} is closed")
        payload = bytes(data)
        self._hub.bytes_sent += len(payload)
        self._send(self._deliver_at(len(payload)), payload)

    def _send(self, arrival: float, payload: Optional[bytes]) -> None:
        self._in_flight.append((arrival, payload))
        asyncio.get_running_loop().call_at(arrival, self._arrive)

    def _arrive(self) -> None:
        # one timer per queued item, and items are queued in arrival order: each timer delivers the front item.
        # (Comparing arrival times with the clock instead lost bytes: the loop runs a timer up to its clock
        # resolution early, and the virtual clock's sums round, so "arrival <= now" could be false for a due item.)
        _, payload = self._in_flight.popleft()
        if self._target.at_eof():
            return
        if payload is None:
            self._target.feed_eof()
        elif self._hub.connected(self._owner, self._remote):
            self._target.feed_data(payload)

    async def drain(self) -> None:
        if not self._hub.connected(self._owner, self._remote):
            raise ConnectionResetError(f"stream {self._owner} -> {self._remote} is closed")
        # backpressure: the sender waits until its bytes are on the wire
        await asyncio.sleep(max(0.0, self._wire_free - asyncio.get_running_loop().time()))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._send(self._deliver_at(0), None)


class _SimDiscovery(InProcessDiscovery):
    def time(self) -> float:
        return EPOCH + asyncio.get_running_loop().time()


class _SimStreams(InProcessStreams):
    writer_class = _LinkWriter

    async def _opening(self, peer_id: str) -> None:
        await asyncio.sleep(self._hub.latency(self._peer_id, peer_id))  # the stream opening costs one trip


@dataclass
class SimHub(Hub):
    """A :class:`Hub` whose streams cross simulated links and whose discovery runs on the loop's virtual clock."""

    links: LinkModel = field(default_factory=LinkModel)
    bytes_sent: int = 0
    """Bytes written to every simulated link so far (all peers, both directions)."""
    _latencies: dict = field(default_factory=dict, repr=False)
    _uplinks: dict = field(default_factory=dict, repr=False)

    def latency(self, a: str, b: str) -> float:
        """The link's one-way latency (s), drawn once per pair (a draw hashes the pair: too slow for every stream)."""
        pair = (a, b) if a < b else (b, a)
        value = self._latencies.get(pair)
        if value is None:
            value = self._latencies[pair] = self.links.latency(a, b)
        return value

    def uplink(self, peer: str) -> float:
        """The peer's uplink bandwidth (bytes/s), drawn once per peer."""
        value = self._uplinks.get(peer)
        if value is None:
            value = self._uplinks[peer] = self.links.uplink(peer)
        return value

    def transport(self, peer_id: str) -> InProcessTransport:
        self._handlers.setdefault(peer_id, {})
        self._down.discard(peer_id)
        return InProcessTransport(_SimDiscovery(self), _SimStreams(self, peer_id))

    def disconnect(self, peer_id: str) -> None:
        self._down.add(peer_id)
        for writer_a, writer_b in self._streams.pop(peer_id, []):
            for writer in (writer_a, writer_b):
                if writer._remote == peer_id and not writer._target.at_eof():
                    writer._target.set_exception(ConnectionResetError(f"{peer_id} is down"))
            writer_a._closed = writer_b._closed = True
            for writer in (writer_a, writer_b):
                if not writer._target.at_eof():
                    writer._target.feed_eof()


# -------------------------------------------------------------------------------------------------------- scenarios


@dataclass
class RoundStats:
    """One simulated round over all peers alive at its start."""

    round: int
    peers: int
    succeeded: int
    group_sizes: dict[int, int]
    seconds_p50: float
    seconds_p95: float
    consensus: float
    """sum_i ||x_i - mean||^2 over the peers alive after the round (:func:`spread`)."""


@dataclass
class SimResult:
    peers: int
    rounds: list[RoundStats]
    wall_s: float
    virtual_s: float
    final: dict[str, torch.Tensor]
    bytes_sent: int = 0
    """Bytes all peers wrote to their links over the whole run (matchmaking and averaging)."""


def spread(vectors: list[torch.Tensor]) -> float:
    """sum_i ||x_i - mean||^2 over the given peers' vectors (float64)."""
    stacked = torch.stack([v.double() for v in vectors])
    return float(((stacked - stacked.mean(0)) ** 2).sum())


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def peer_names(n: int) -> list[str]:
    width = len(str(n - 1))
    return [f"sim{i:0{width}d}" for i in range(n)]


def initial_vectors(names: list[str], numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {p: torch.randn(numel, generator=gen) for p in names}


async def _moshpit(n: int, rounds: int, group_size: int, numel: int, links: LinkModel, failure_rate: float,
                   seed: int, matchmaking_timeout_s: float, compression: str, rendezvous: str) -> SimResult:
    started = time.perf_counter()
    hub = SimHub(links=links)
    names = peer_names(n)
    state = initial_vectors(names, numel, seed)
    mm_cfg = MatchmakingConfig(matchmaking_timeout_s, min(5.0, matchmaking_timeout_s / 2), 0.5)
    ar_cfg = AllReduceConfig(compression, 30.0, 60.0)
    averagers = {}
    for p in names:
        transport = hub.transport(p)
        mm, ar = Matchmaker(transport, "sim", mm_cfg), ButterflyAllReduce(transport, "sim", ar_cfg)
        await mm.start()
        await ar.start()
        averagers[p] = MoshpitAverager(mm, ar, group_size, rendezvous)
    rng = random.Random(seed)
    alive = list(names)
    loop = asyncio.get_running_loop()
    stats = []
    for r in range(rounds):
        # churn: each alive peer crashes during this round with probability failure_rate, at a random moment
        crashing = [p for p in alive if rng.random() < failure_rate]
        for p in crashing:
            loop.call_later(rng.uniform(0.0, 1.0), hub.disconnect, p)
        outcomes: dict[str, tuple[bool, int, float]] = {}
        view = tuple(alive)  # one object shared by every peer: the sharded rendezvous sorts it once

        async def one(p: str) -> None:
            t0 = loop.time()
            try:
                res = await averagers[p].average(r, state[p], 1.0, view)
                state[p] = res.averaged
                outcomes[p] = (True, res.group_size, loop.time() - t0)
            except (MatchmakingFailed, AllReduceFailed, ConnectionError):
                outcomes[p] = (False, 0, loop.time() - t0)

        await asyncio.gather(*(one(p) for p in alive))
        survivors = [p for p in alive if p not in crashing]
        ok = [p for p in survivors if outcomes[p][0]]
        sizes: dict[int, int] = {}
        for p in ok:
            sizes[outcomes[p][1]] = sizes.get(outcomes[p][1], 0) + 1
        times = [outcomes[p][2] for p in ok]
        stats.append(RoundStats(r + 1, len(survivors), len(ok), sizes, _percentile(times, 0.5),
                                _percentile(times, 0.95), spread([state[p] for p in survivors])))
        alive = survivors
    return SimResult(n, stats, time.perf_counter() - started, loop.time(), {p: state[p] for p in alive},
                     hub.bytes_sent)


def simulate_moshpit(n: int, rounds: int, group_size: int = 4, numel: int = 64, links: LinkModel = LinkModel(),
                     failure_rate: float = 0.0, seed: int = 0, matchmaking_timeout_s: float = 30.0,
                     compression: str = "none", rendezvous: str = "group") -> SimResult:
    """``rounds`` Moshpit rounds among ``n`` simulated peers, each starting from ``randn(numel)``; a fraction
    ``failure_rate`` of the alive peers crashes in each round (their groups' all-reduce fails, they are gone for
    later rounds). Rounds are synchronous: round r+1 starts when every peer finished round r.

    ``rendezvous``: ``"group"`` (default: the sharded rendezvous, every peer meets only its groupmates; thousands of
    peers) or ``"round"`` (one rendezvous of all peers per round, O(N^2) bytes: a few hundred peers at most); see
    :class:`~protocols.moshpit.MoshpitAverager`."""
    return run_virtual(_moshpit(n, rounds, group_size, numel, links, failure_rate, seed, matchmaking_timeout_s,
                                compression, rendezvous))


async def _gossip(n: int, rounds: int, partners: int, numel: int, links: LinkModel, seed: int,
                  compression: str) -> tuple[SimResult, list[int]]:
    started = time.perf_counter()
    hub = SimHub(links=links)
    names = peer_names(n)
    state = {p: [x, 1.0] for p, x in initial_vectors(names, numel, seed).items()}
    averagers = {}
    for i, p in enumerate(names):
        def get_state(p=p):
            return state[p][0], state[p][1]

        def set_state(x, w, p=p):
            state[p] = [x, w]

        g = GossipAverager(hub.transport(p), "sim", GossipConfig(partners, compression, 30.0), get_state, set_state,
                           seed=seed * 1_000_003 + i)
        await g.start()
        averagers[p] = g
    loop = asyncio.get_running_loop()
    stats, exchanges = [], []
    for r in range(rounds):
        outcomes = {}

        async def one(p: str) -> None:
            t0 = loop.time()
            res = await averagers[p].gossip_round(names)
            outcomes[p] = (res.exchanges, loop.time() - t0)

        await asyncio.gather(*(one(p) for p in names))
        times = [t for _, t in outcomes.values()]
        exchanges.append(sum(e for e, _ in outcomes.values()))
        stats.append(RoundStats(r + 1, n, sum(e > 0 for e, _ in outcomes.values()), {2: exchanges[-1]},
                                _percentile(times, 0.5), _percentile(times, 0.95),
                                spread([state[p][0] for p in names])))
    return (SimResult(n, stats, time.perf_counter() - started, loop.time(), {p: state[p][0] for p in names},
                      hub.bytes_sent), exchanges)


def simulate_gossip(n: int, rounds: int, partners: int = 1, numel: int = 64, links: LinkModel = LinkModel(),
                    seed: int = 0, compression: str = "none") -> tuple[SimResult, list[int]]:
    """``rounds`` gossip rounds among ``n`` simulated peers (equal weights); returns the result and the number of
    completed pairwise exchanges in each round (``RoundStats.group_sizes`` holds it under key 2)."""
    return run_virtual(_gossip(n, rounds, partners, numel, links, seed, compression))


def gossip_rate_per_exchange(n: int) -> float:
    """Expected factor by which sum_i ||x_i - mean||^2 shrinks in one uniformly random pairwise average among ``n``
    peers: the second eigenvalue of E[W] = I - (I - 11^T/n)/(n-1), i.e. 1 - 1/(n-1) (Boyd et al. 2006)."""
    return 1.0 - 1.0 / (n - 1)
