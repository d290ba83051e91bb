"""The swarm simulator (peerd.testing.sim) checked against the pure cores: Moshpit's exact average after d rounds on a
full grid, and gossip's consensus decay at the spectral-gap rate."""

import asyncio
import math
import time

import pytest
import torch

from peerd.testing.sim import (LinkModel, SimHub, gossip_rate_per_exchange, initial_vectors, peer_names, run_virtual,
                               simulate_gossip, simulate_moshpit, spread)


@pytest.mark.timeout(30)
def test_virtual_clock_jumps_over_waits():
    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.gather(asyncio.sleep(100.0), asyncio.sleep(30.0))
        return loop.time() - t0

    started = time.perf_counter()
    assert run_virtual(main()) == pytest.approx(100.0)
    assert time.perf_counter() - started < 5.0


@pytest.mark.timeout(30)
def test_links_delay_bytes_by_latency_plus_size_over_bandwidth_in_order():
    links = LinkModel(latency_median_s=0.05, latency_sigma=0.0, bandwidth_median_Bps=1000.0, bandwidth_sigma=0.0)

    async def main():
        hub = SimHub(links=links)
        got = []

        async def echo(peer, reader, writer):
            got.append((await reader.readexactly(500), asyncio.get_running_loop().time()))
            got.append((await reader.read(), asyncio.get_running_loop().time()))

        await hub.transport("b").streams.add_handler("echo", echo)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        _, writer = await hub.transport("a").streams.open("b", "echo")  # opening costs one latency
        writer.write(b"x" * 500)
        writer.write(b"y" * 100)
        writer.close()
        while len(got) < 2:
            await asyncio.sleep(0.01)
        return [(data, t - t0) for data, t in got]

    (first, t_first), (rest, t_rest) = run_virtual(main())
    assert first == b"x" * 500 and rest == b"y" * 100
    assert t_first == pytest.approx(0.05 + 0.5 + 0.05, abs=0.02)  # open + 500 B at 1000 B/s + latency
    assert t_rest == pytest.approx(0.05 + 0.6 + 0.05, abs=0.02)


@pytest.mark.timeout(120)
def test_moshpit_256_simulated_peers_exact_average_after_4_rounds():
    n, numel = 256, 16  # 256 = 4^4: a full 4 x 4 x 4 x 4 grid
    result = simulate_moshpit(n, 4, group_size=4, numel=numel, seed=3)
    assert [r.succeeded for r in result.rounds] == [n] * 4
    assert [r.group_sizes for r in result.rounds] == [{4: n}] * 4
    start = spread(list(initial_vectors(peer_names(n), numel, seed=3).values()))
    # each round averages along one more grid dimension: the spread shrinks but stays until the last one
    assert all(r.consensus > 1e-3 * start for r in result.rounds[:3])
    assert result.rounds[3].consensus < 1e-9 * start
    mean = torch.stack(list(initial_vectors(peer_names(n), numel, seed=3).values())).mean(0)
    for x in result.final.values():
        torch.testing.assert_close(x, mean, rtol=0, atol=1e-5)


@pytest.mark.timeout(120)
def test_gossip_consensus_decays_at_the_spectral_gap_rate():
    n, numel, rounds = 64, 256, 6
    ratios = []
    for seed in (0, 1):
        result, exchanges = simulate_gossip(n, rounds, partners=1, numel=numel, seed=seed)
        start = spread(list(initial_vectors(peer_names(n), numel, seed).values()))
        per_exchange = math.log(result.rounds[-1].consensus / start) / sum(exchanges)
        ratios.append(per_exchange / math.log(gossip_rate_per_exchange(n)))
    # iid uniformly random pairs shrink the squared spread by 1 - 1/(N-1) per exchange; a round in which every peer
    # starts one exchange is closer to a random matching (no pair averaged twice in a row), a little faster still
    assert all(0.9 <= r <= 1.35 for r in ratios), ratios


@pytest.mark.timeout(60)
def test_sharded_rendezvous_bytes_per_peer_do_not_grow_with_the_swarm():
    """The sharded rendezvous meets only the groupmates: bytes per peer and round stay flat from 16 to 64 peers,
    while one rendezvous of everyone sends every peer the whole member list (grows with N)."""
    def per_peer(n, rendezvous):
        result = simulate_moshpit(n, 1, group_size=4, numel=16, rendezvous=rendezvous)
        assert result.rounds[0].succeeded == n and result.rounds[0].group_sizes == {4: n}
        return result.bytes_sent / n

    sharded = per_peer(64, "group") / per_peer(16, "group")
    everyone = per_peer(64, "round") / per_peer(16, "round")
    assert 0.8 < sharded < 1.2, sharded
    assert everyone > 1.5, everyone
