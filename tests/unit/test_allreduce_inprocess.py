"""Matchmaking + butterfly all-reduce among in-process peers (no sockets)."""

import asyncio

import pytest
import torch

from peerd.transport.inprocess import Hub
from protocols.allgather import SparseAllGather
from protocols.allreduce import (AllReduceConfig, AllReduceFailed, ButterflyAllReduce, PartReducer, RingAllReduce,
                                 partition_sizes)
from protocols.allreduce.aggregate import prepare_out
from protocols.diloco import weighted_average
from protocols.matchmaking import AdmissionRefused, MatchmakingConfig, Matchmaker, MatchmakingFailed

pytestmark = pytest.mark.timeout(60)

FP16 = AllReduceConfig(compression="fp16", sender_timeout_s=1.0, reducer_timeout_s=2.0)


def test_partition_sizes():
    assert partition_sizes(10, 3) == [4, 3, 3]
    assert sum(partition_sizes(7, 7)) == 7
    with pytest.raises(ValueError):
        partition_sizes(5, 0)


def test_part_reducer_rejects_bad_parts_without_changing_the_sum():
    r = PartReducer(3)
    r.add("a", torch.ones(3), 2.0)
    for bad in [(torch.ones(4), 1.0), (torch.tensor([1.0, float("nan"), 0.0]), 1.0), (torch.ones(3), -1.0),
                (torch.ones(3), float("inf")), (torch.ones(3, dtype=torch.float64), 1.0)]:
        with pytest.raises(ValueError):
            r.add("b", *bad)
    with pytest.raises(ValueError):
        r.add("a", torch.ones(3), 1.0)
    r.add("c", torch.full((3,), 4.0), 1.0)
    assert torch.equal(r.mean(), torch.full((3,), 2.0))
    assert r.contributors == ["a", "c"]


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_the_average_written_over_the_input_has_the_bits_of_a_fresh_one(compression, averaging_peers):
    """``run(..., out=tensor)``: every part's average lands in the input's own buffer (4P bytes less), bit for bit
    what a fresh buffer gets; several chunks a part, so answers arrive while the same part's later chunks are
    still being sent."""

    async def main():
        config = AllReduceConfig(compression=compression, sender_timeout_s=2.0, reducer_timeout_s=4.0,
                                 chunk_numel=4096)
        peers = await averaging_peers(Hub(), 4, allreduce=config)
        g = torch.Generator().manual_seed(7)
        xs, ws = [torch.randn(50_003, generator=g) for _ in range(4)], [1.0, 2.0, 3.0, 4.0]
        fresh = await asyncio.gather(*[p.round("r0", x.clone(), w, expected=4) for p, x, w in zip(peers, xs, ws)])
        ins = [x.clone() for x in xs]
        over = await asyncio.gather(*[p.round("r1", y, w, expected=4, out=y) for p, y, w in zip(peers, ins, ws)])
        for y, a, b in zip(ins, over, fresh):
            assert a.averaged.data_ptr() == y.data_ptr()
            assert torch.equal(a.averaged, b.averaged)

    asyncio.run(main())


def test_an_out_buffer_is_refused_with_a_sparse_codec_or_of_the_wrong_shape():
    x = torch.zeros(8)
    assert prepare_out(None, x, sparse=True) is None and prepare_out(x, x, sparse=False) is x
    for bad, sparse in ((x, True), (torch.zeros(7), False), (torch.zeros(8, dtype=torch.float64), False),
                        (torch.zeros(16)[::2], False)):
        with pytest.raises(ValueError):
            prepare_out(bad, x, sparse=sparse)


@pytest.mark.parametrize("n", [1, 2, 4, 5])
def test_weighted_mean_bit_identical_on_every_member(n, averaging_peers):
    async def main():
        hub = Hub()
        peers = await averaging_peers(hub, n)
        g = torch.Generator().manual_seed(n)
        xs = [torch.randn(1003, generator=g) for _ in range(n)]
        ws = [float(i + 1) for i in range(n)]
        results = await asyncio.gather(*[p.round("r0", x, w, expected=n) for p, x, w in zip(peers, xs, ws)])
        reference = weighted_average(xs, ws)
        for res in results:
            assert res.group_size == n
            assert torch.equal(res.averaged, results[0].averaged)
            torch.testing.assert_close(res.averaged, reference, rtol=1e-5, atol=1e-6)
        if n > 1:
            assert all(res.bytes_sent > 0 and res.bytes_received > 0 for res in results)

    asyncio.run(main())


def test_fp16_results_identical_across_members(averaging_peers):
    async def main():
        hub = Hub()
        peers = await averaging_peers(hub, 3, allreduce=FP16)
        xs = [torch.randn(5000) for _ in range(3)]
        results = await asyncio.gather(*[p.round("r0", x, 1.0, expected=3) for p, x in zip(peers, xs)])
        for res in results:
            assert torch.equal(res.averaged, results[0].averaged)
        err = (results[0].averaged - weighted_average(xs, [1, 1, 1])).norm() / weighted_average(xs, [1, 1, 1]).norm()
        assert err < 1e-3

    asyncio.run(main())


def test_staggered_arrivals_form_one_group_without_expected_size(averaging_peers):
    async def main():
        hub = Hub()
        peers = await averaging_peers(hub, 3)

        async def late(peer, delay, x):
            await asyncio.sleep(delay)
            return await peer.round("r1", x, 1.0, expected=3)

        xs = [torch.full((10,), float(i)) for i in range(3)]
        results = await asyncio.gather(*[late(p, 0.3 * i, x) for i, (p, x) in enumerate(zip(peers, xs))])
        for res in results:
            assert res.group_size == 3
            assert torch.equal(res.averaged, torch.full((10,), 1.0))

    asyncio.run(main())


def test_window_expires_with_the_peers_present(averaging_peers):
    async def main():
        hub = Hub()
        peers = await averaging_peers(hub, 3)
        xs = [torch.full((8,), float(i)) for i in range(2)]
        # expected 3 but only 2 come: the group seals when the matchmaking window ends
        results = await asyncio.gather(*[p.round("r2", x, 1.0, expected=3) for p, x in zip(peers[:2], xs)])
        assert [r.group_size for r in results] == [2, 2]
        assert torch.equal(results[0].averaged, torch.full((8,), 0.5))

    asyncio.run(main())


def test_admission_refusal_reaches_the_refused_peer(averaging_peers):
    async def main():
        hub = Hub()
        admit = lambda own, peer, info: None if info.get("digest") == own.get("digest") else "digest differs"
        peers = await averaging_peers(hub, 3, admit=admit)
        x = torch.zeros(4)
        tasks = [
            peers[0].round("r3", x, 1.0, expected=2, info={"digest": "a"}),
            peers[1].round("r3", x, 1.0, expected=2, info={"digest": "a"}),
            peers[2].round("r3", x, 1.0, expected=2, info={"digest": "b"}),
        ]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert results[0].group_size == results[1].group_size == 2
        assert isinstance(results[2], AdmissionRefused)

    asyncio.run(main())


def test_dead_registrant_is_skipped_and_min_group_size_enforced(averaging_peers):
    async def main():
        hub = Hub()
        peers = await averaging_peers(hub, 3)
        # peer00 registers, then vanishes: the others must route around the smallest PeerID
        t = asyncio.ensure_future(peers[0].matchmaker.form_group("r4", {}, expected_size=3))
        await asyncio.sleep(0.1)
        hub.disconnect("peer00")
        xs = [torch.full((6,), 2.0), torch.full((6,), 4.0)]
        results = await asyncio.gather(*[p.round("r4", x, 1.0, expected=2) for p, x in zip(peers[1:], xs)])
        assert all(torch.equal(r.averaged, torch.full((6,), 3.0)) for r in results)
        t.cancel()
        strict = Matchmaker(hub.transport("peer09"), "run",
                            MatchmakingConfig(matchmaking_timeout_s=0.5, request_timeout_s=0.2,
                                              poll_interval_s=0.05, min_group_size=2))
        await strict.start()
        with pytest.raises(MatchmakingFailed):
            await strict.form_group("r5", {})

    asyncio.run(main())


def test_reducer_death_fails_the_round_for_everyone_and_a_late_sender_still_gets_the_mean(averaging_peers):
    async def main():
        hub = Hub()
        peers = await averaging_peers(hub, 3)
        groups = await asyncio.gather(*[p.matchmaker.form_group("r6", {}, expected_size=3) for p in peers])
        hub.disconnect(groups[0].members[2])
        survivors = [p for p in peers if p.matchmaker.peer_id != groups[0].members[2]]
        results = await asyncio.gather(*[p.allreduce.run(groups[0], torch.ones(30), 1.0) for p in survivors],
                                       return_exceptions=True)
        assert all(isinstance(r, AllReduceFailed) for r in results)

    asyncio.run(main())


def test_malformed_part_excludes_sender_and_keeps_the_mean_of_the_honest(averaging_peers):
    async def main():
        hub = Hub()
        peers = await averaging_peers(hub, 3)
        groups = await asyncio.gather(*[p.matchmaker.form_group("r7", {}, expected_size=3) for p in peers])
        group = groups[0]
        by_id = {p.matchmaker.peer_id: p for p in peers}
        bad = group.members[1]
        # the bad peer sends a part with NaN; the honest ones average normally
        honest = [m for m in group.members if m != bad]
        xs = {m: torch.full((9,), float(i)) for i, m in enumerate(group.members)}
        xs[bad] = torch.full((9,), float("nan"))
        codec_ok = [by_id[m].allreduce.run(group, xs[m], 1.0) for m in honest]
        bad_run = by_id[bad].allreduce.run(group, torch.full((9,), 5.0), 1.0)
        # the bad member reduces honestly but sends NaN parts to the others
        by_id[bad].allreduce._encode_part = lambda part: torch.full_like(part, float("nan")).numpy().tobytes()
        results = await asyncio.gather(*codec_ok, bad_run, return_exceptions=True)
        for r in results[:2]:
            assert not isinstance(r, BaseException), r
        assert torch.equal(results[0].averaged, results[1].averaged)
        # honest reducers excluded the bad sender: their parts are the honest mean; the bad member's own part
        # (reduced by itself, honestly) also holds its local 5.0
        honest_mean = (xs[honest[0]] + xs[honest[1]]) / 2
        expected = honest_mean.clone()
        expected[3:6] = (xs[honest[0]][3:6] + xs[honest[1]][3:6] + 5.0) / 3
        assert torch.equal(results[0].averaged, expected)
        assert sum(bad in r.excluded for r in results[:2]) == 2

    asyncio.run(main())


def test_bytes_sent_count_both_directions_of_the_butterfly(averaging_peers):
    async def main():
        hub = Hub()
        n, numel = 4, 4000
        peers = await averaging_peers(hub, n, allreduce=FP16)
        results = await asyncio.gather(*[p.round("r8", torch.randn(numel), 1.0, expected=n) for p in peers])
        payload = 2 * (n - 1) / n * numel * 2  # each peer sends (N-1)/N of the vector and (N-1) answers of 1/N
        for r in results:
            assert payload <= r.bytes_sent <= payload * 1.1, (r.bytes_sent, payload)
            assert payload <= r.bytes_received <= payload * 1.1

    asyncio.run(main())


@pytest.mark.parametrize("compression, exchange", [("fp16", "reduce"), ("topk", "reduce"), ("topk", "gather"),
                                                   ("fp16", "ring")])
def test_a_group_of_one_returns_its_own_vector_exactly_without_a_copy(compression, exchange, averaging_peers):
    """Alone there is nothing to average and nothing travels: the result is the input itself (the same buffer, no
    codec round trip), ``sent`` is it too for a sparse codec (the error feedback records no error), no bytes."""
    async def main():
        config = AllReduceConfig(compression=compression, exchange=exchange, sender_timeout_s=1.0,
                                 reducer_timeout_s=2.0)
        cls = {"gather": SparseAllGather, "ring": RingAllReduce}.get(exchange, ButterflyAllReduce)
        [peer] = await averaging_peers(Hub(), 1, allreduce=config, allreduce_class=cls)
        x = torch.randn(10_007, generator=torch.Generator().manual_seed(1)) * 1e-3  # fp16 would round these
        res = await peer.round("alone", x, 3.0, expected=1)
        assert res.group_size == 1 and res.averaged.data_ptr() == x.data_ptr() and torch.equal(res.averaged, x)
        assert (res.bytes_sent, res.bytes_received, res.part_sizes) == (0, 0, (x.numel(),))
        assert res.sent.data_ptr() == x.data_ptr() if compression == "topk" else res.sent is None

    asyncio.run(main())
