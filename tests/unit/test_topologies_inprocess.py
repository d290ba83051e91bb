"""Moshpit and gossip averaging among in-process peers (pure grid logic, convergence, weights, failures)."""

import asyncio
import random

import pytest
import torch

from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceConfig
from protocols.diloco import weighted_average
from protocols.gossip import GossipAverager, GossipConfig, choose_partners, consensus_distance, pair_average
from protocols.matchmaking import MatchmakingConfig, MatchmakingFailed
from protocols.moshpit import Grid, MoshpitAverager, assign, group_mates, round_to_join
from tests.streams import breaking_transport

pytestmark = pytest.mark.timeout(60)


def test_grid_shapes():
    assert (Grid.for_peers(4, 2).side, Grid.for_peers(4, 2).dims) == (2, 2)
    assert (Grid.for_peers(16, 4).side, Grid.for_peers(16, 4).dims) == (4, 2)
    assert (Grid.for_peers(8, 2).side, Grid.for_peers(8, 2).dims) == (2, 3)
    assert (Grid.for_peers(3, 4).side, Grid.for_peers(3, 4).dims) == (3, 1)
    assert Grid.for_peers(1, 4).dims == 1
    assert (Grid.for_peers(3, 2).side, Grid.for_peers(3, 2).dims) == (3, 1)  # one group, nobody alone
    assert (Grid.for_peers(5, 2).side, Grid.for_peers(5, 2).dims) == (2, 3)
    assert (Grid.for_peers(15, 4).side, Grid.for_peers(15, 4).dims) == (4, 2)  # not one group of 15
    assert Grid(2, 2, 4).coordinates(3) == (1, 1)
    with pytest.raises(ValueError):
        Grid.for_peers(4, 1)


def test_assignments_partition_the_peers_into_orthogonal_groups():
    peers = [f"p{i}" for i in range(4)]
    rounds = []
    for r in (0, 1):
        groups = {}
        for p in peers:
            a = assign(p, peers, r, 2)
            groups.setdefault(a.key, set()).add(p)
            assert a.expected_size == 2
        assert sorted(len(g) for g in groups.values()) == [2, 2]
        rounds.append(list(groups.values()))
    # no pair of peers shares a group in both rounds: that is what makes 2 rounds exact
    for g0 in rounds[0]:
        for g1 in rounds[1]:
            assert len(g0 & g1) == 1


def test_round_to_join_skips_only_when_every_groupmate_moved_on():
    peers = ["a", "b", "c", "d"]
    mates = group_mates("a", peers, 0, 2)
    assert len(mates) == 1
    others = [p for p in peers if p not in mates and p != "a"]
    # the groupmate is still at round 0: wait for it, even if the other group is ahead
    assert round_to_join("a", {mates[0]: 0, **{p: 3 for p in others}}, 0, 2) == 0
    # the groupmate already left round 0: follow it
    assert round_to_join("a", {mates[0]: 1, **{p: 1 for p in others}}, 0, 2) >= 1


def test_pair_average_is_symmetric_and_preserves_mass():
    a, b = torch.randn(100), torch.randn(100)
    x1, w1 = pair_average(a, 3.0, b, 1.0)
    x2, w2 = pair_average(b, 1.0, a, 3.0)
    assert torch.equal(x1, x2) and w1 == w2 == 2.0
    torch.testing.assert_close(x1 * 2 * w1, a * 3 + b * 1)
    assert choose_partners(["a", "b", "c"], "a", 5, random.Random(0)) in (["b", "c"], ["c", "b"])


async def _moshpit_peers(averaging_peers, hub, n, target, min_group_size=1):
    mm_cfg = MatchmakingConfig(matchmaking_timeout_s=2.0, request_timeout_s=0.5, poll_interval_s=0.05,
                               min_group_size=min_group_size)
    peers = await averaging_peers(hub, n, "m", mm_cfg, AllReduceConfig("none", 1.0, 2.0))
    return [MoshpitAverager(p.matchmaker, p.allreduce, target) for p in peers]


def test_moshpit_4_peers_2x2_grid_exact_average_after_2_rounds(averaging_peers):
    async def main():
        hub = Hub()
        peers = await _moshpit_peers(averaging_peers, hub, 4, 2)
        names = [f"peer{i:02d}" for i in range(4)]
        xs = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        ws = [1.0, 2.0, 3.0, 4.0]
        reference = weighted_average(xs, ws)
        state, weights = list(xs), list(ws)
        for r in range(2):
            results = await asyncio.gather(*[p.average(r, x, w, names) for p, x, w in zip(peers, state, weights)])
            assert all(res.group_size == 2 for res in results)
            state = [res.averaged for res in results]
            weights = _group_weights(names, r, weights)  # a member speaks for its whole group next round
        for x in state:
            torch.testing.assert_close(x, reference, rtol=1e-5, atol=1e-6)

    asyncio.run(main())


def test_moshpit_groups_come_from_the_rendezvous_not_from_each_peers_view(averaging_peers):
    """Views that disagree (a dead peer still listed by some, a live one missing from another) cannot split the grid:
    every survivor lands in the same 2 x 2 grid, built from the sealed rendezvous."""

    async def main():
        hub = Hub()
        peers = await _moshpit_peers(averaging_peers, hub, 4, 2)
        names = [f"peer{i:02d}" for i in range(4)]
        views = [names + ["peer99-dead"], names + ["peer99-dead"], names, names[1:]]
        xs = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        reference = weighted_average(xs, [1.0] * 4)
        state = list(xs)
        for r in range(2):
            results = await asyncio.gather(*[p.average(r, x, 1.0, v) for p, x, v in zip(peers, state, views)])
            assert [res.group_size for res in results] == [2, 2, 2, 2]
            state = [res.averaged for res in results]
        for x in state:
            torch.testing.assert_close(x, reference, rtol=1e-5, atol=1e-6)

    asyncio.run(main())


def _count_probes(peers):
    """Record every probe a peer's matchmaker makes as (probed peer, answer) in the returned list."""
    probes = []
    for p in peers:
        probe = p.matchmaker._probe

        async def counted(peer, probe=probe):
            answer = await probe(peer)
            probes.append((peer, answer))
            return answer

        p.matchmaker._probe = counted
    return probes


async def _probed_moshpit_peers(averaging_peers):
    """4 moshpit peers (M = 2) with a 1 s idle window and 30 s ``max_wait_s``, their probes counted: (averagers,
    probes, names, one (100,) vector each)."""
    mm_cfg = MatchmakingConfig(matchmaking_timeout_s=1.0, request_timeout_s=0.5, poll_interval_s=0.05, max_wait_s=30.0)
    peers = await averaging_peers(Hub(), 4, "m", mm_cfg, AllReduceConfig("none", 5.0, 10.0))
    probes = _count_probes(peers)
    names = [f"peer{i:02d}" for i in range(4)]
    xs = [torch.full((100,), float(i)) for i in range(4)]
    return [MoshpitAverager(p.matchmaker, p.allreduce, 2) for p in peers], probes, names, xs


def test_a_rendezvous_told_who_is_coming_waits_past_its_idle_window_for_them(averaging_peers):
    """With ``coming``, the round's rendezvous waits for the listed peers instead of sealing after its idle window:
    a peer that arrives only after the others were idle long enough to probe it still lands in the round's 2 x 2
    grid (sealed on the window, the three would have averaged as one group of 3 and left it to a late group)."""

    async def main():
        averagers, probes, names, xs = await _probed_moshpit_peers(averaging_peers)
        early = [asyncio.ensure_future(a.average(0, x, 1.0, names, coming=names))
                 for a, x in zip(averagers[:3], xs[:3])]
        while not any(peer == "peer03" and answer is not None for peer, answer in probes):
            await asyncio.sleep(0.02)  # the rendezvous outlived its idle window and found peer03 alive
        assert not any(task.done() for task in early)
        results = await asyncio.gather(*early, averagers[3].average(0, xs[3], 1.0, names, coming=names))
        assert [res.group_size for res in results] == [2, 2, 2, 2]

    asyncio.run(main())


def test_a_coming_peer_that_is_dead_is_left_out_after_two_unanswered_probes(averaging_peers):
    async def main():
        averagers, probes, names, xs = await _probed_moshpit_peers(averaging_peers)
        coming = [*names, "peer99-dead"]
        results = await asyncio.gather(*[a.average(0, x, 1.0, coming, coming=coming) for a, x in zip(averagers, xs)])
        assert [res.group_size for res in results] == [2, 2, 2, 2]  # the grid of the 4 who came, not of 5
        assert probes == [("peer99-dead", None)] * 2

    asyncio.run(main())


def test_moshpit_lone_grid_peer_fails_its_round_under_min_group_size(averaging_peers):
    """5 peers on a 2 x 2 x 2 grid leave some peer alone along some dimension; with min_group_size = 2 that peer's
    round fails (MatchmakingFailed) while the others average in their groups."""

    async def main():
        hub = Hub()
        peers = await _moshpit_peers(averaging_peers, hub, 5, 2, min_group_size=2)
        names = [f"peer{i:02d}" for i in range(5)]
        lone = {r: [p for p in names if not group_mates(p, names, r, 2)] for r in range(3)}
        r = next(r for r, ps in lone.items() if ps)
        xs = [torch.full((100,), float(i)) for i in range(5)]
        results = await asyncio.gather(*[p.average(r, x, 1.0, names) for p, x in zip(peers, xs)],
                                       return_exceptions=True)
        failed = [names[i] for i, res in enumerate(results) if isinstance(res, MatchmakingFailed)]
        assert failed == lone[r] and "min_group_size=2" in str(results[names.index(failed[0])])
        assert all(res.group_size >= 2 for res in results if not isinstance(res, BaseException))

    asyncio.run(main())


def _group_weights(names, r, weights):
    """Weight a member carries after round r: the mean weight of its group (keeps sum w x consistent)."""
    out = []
    for p in names:
        a = assign(p, names, r, 2)
        members = [i for i, q in enumerate(names) if assign(q, names, r, 2).key == a.key]
        out.append(sum(weights[i] for i in members) / len(members))
    return out


async def _gossip_peers(hub, xs, ws, k=2, compression="none", wrap=None):
    """Gossip averagers ``g00``... on ``hub``, each over a state ``[x, w]`` (returned too); ``wrap(index,
    transport)``: e.g. a fault-injecting wrapper for one peer."""
    states = [[x.clone(), w] for x, w in zip(xs, ws)]
    peers = []
    for i, st in enumerate(states):
        t = hub.transport(f"g{i:02d}")
        if wrap is not None:
            t = wrap(i, t)

        def getter(st=st):
            return st[0], st[1]

        def setter(x, w, st=st):
            st[0], st[1] = x, w

        g = GossipAverager(t, "g", GossipConfig(k, compression, 2.0), getter, setter, seed=i)
        await g.start()
        peers.append(g)
    return peers, states


def test_gossip_8_peers_reaches_the_weighted_average():
    async def main():
        hub = Hub()
        n = 8
        xs = [torch.randn(2000, generator=torch.Generator().manual_seed(i)) for i in range(n)]
        ws = [float(i + 1) for i in range(n)]
        reference = weighted_average(xs, ws)
        peers, states = await _gossip_peers(hub, xs, ws)
        names = [f"g{i:02d}" for i in range(n)]
        distances = []
        for r in range(30):
            await asyncio.gather(*[p.gossip_round(names) for p in peers])
            distances.append(consensus_distance([s[0] for s in states]))
            if distances[-1] < 1e-3:
                break
        assert distances[-1] < 1e-3, distances
        assert len(distances) <= 30
        for s in states:
            torch.testing.assert_close(s[0], reference, rtol=2e-3, atol=2e-3)
        # push-sum keeps the total weight
        assert abs(sum(s[1] for s in states) - sum(ws)) < 1e-6

    asyncio.run(main())


def test_a_gossip_exchange_whose_stream_breaks_is_refused_without_a_ban():
    # the answering peer loses its connection halfway through the initiator's vector (a crash, a dropped link, a
    # record altered on the path): the exchange fails, nobody is banned (the answerer's refusal is no lie either),
    # and neither state changed
    async def main():
        hub = Hub()
        xs = [torch.full((2000,), float(i)) for i in range(2)]
        fired = []
        peers, states = await _gossip_peers(
            hub, xs, [1.0, 1.0], k=1,
            wrap=lambda i, t: breaking_transport(t, ".gossip", "g00", 4000, fired) if i == 1 else t)
        result = await peers[0].gossip_round(["g00", "g01"])
        assert len(fired) == 1 and result.failed == 1, (fired, result)
        assert peers[1].bans.active() == {}
        assert peers[0].bans.active() == {}  # only the answerer's side broke here: the initiator read its refusal
        assert all(torch.equal(st[0], x) and st[1] == 1.0 for st, x in zip(states, xs))

    asyncio.run(main())


def test_gossip_survives_a_dead_peer_and_the_rest_converge():
    async def main():
        hub = Hub()
        n = 6
        xs = [torch.full((50,), float(i)) for i in range(n)]
        peers, states = await _gossip_peers(hub, xs, [1.0] * n, compression="fp16")
        names = [f"g{i:02d}" for i in range(n)]
        await asyncio.gather(*[p.gossip_round(names) for p in peers])
        hub.disconnect("g05")
        failed = 0
        for _ in range(25):
            results = await asyncio.gather(*[p.gossip_round(names) for p in peers[:-1]])
            failed += sum(r.failed for r in results)
        assert failed > 0  # the dead peer was tried and skipped
        alive = [s[0] for s in states[:-1]]
        assert consensus_distance(alive) < 1e-3

    asyncio.run(main())
