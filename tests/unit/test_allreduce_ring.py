"""The pipelined ring all-reduce (``exchange = "ring"``) among in-process peers: the weighted mean, bit-identical on
every member, the bytes of a ring, the groups it leaves to the butterfly, and its failures."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from peerd.transport.inprocess import Hub
from protocols.allreduce import (RATE_MIN_BYTES, RATE_MIN_RUNS, RING_REMEASURE_RUNS, AllReduceConfig, AllReduceFailed,
                                 RingAllReduce)
from protocols.diloco import weighted_average
from protocols.matchmaking import Group

pytestmark = pytest.mark.timeout(60)

#: Small chunks so that every part travels in several frames (the pipeline), short timeouts (nothing here waits on
#: a network).
RING = AllReduceConfig(compression="none", sender_timeout_s=1.0, reducer_timeout_s=3.0, chunk_numel=4096,
                       exchange="ring")
#: What a member announces once its butterfly runs measured its link (equal links: the ring fits).
RATES = {"rates": {"up": 1.25e7, "down": 1.25e7}}


def inputs(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n)]


@pytest.mark.parametrize("n", [3, 4, 5])
def test_every_member_gets_the_same_bits_of_the_weighted_mean_in_a_ring(n, averaging_peers):
    async def main():
        peers = await averaging_peers(Hub(), n, allreduce=RING, allreduce_class=RingAllReduce)
        numel = 50_003  # parts of ~10-17k values: several 4096-value frames each, the last one short
        xs, ws = inputs(n, numel, n), [float(i + 1) for i in range(n)]
        results = await asyncio.gather(*[p.round("r0", x, w, expected=n, info=RATES) for p, x, w in zip(peers, xs, ws)])
        reference = weighted_average(xs, ws)
        for peer, res in zip(peers, results):
            assert peer.allreduce.rings_run == 1
            assert res.group_size == n and res.contributors == n and res.excluded == {}
            assert torch.equal(res.averaged, results[0].averaged)
            torch.testing.assert_close(res.averaged, reference, rtol=1e-5, atol=1e-6)
            # a ring moves 2 (N-1)/N of the vector each way (plus 8 bytes of running weight per frame, headers)
            payload = 2 * (n - 1) / n * 4 * numel
            assert payload <= res.bytes_sent <= payload * 1.02 + 4096
            assert payload <= res.bytes_received <= payload * 1.02 + 4096

    asyncio.run(main())


def test_a_ring_writes_the_average_over_the_input_bit_for_bit(averaging_peers):
    async def main():
        n, numel = 4, 50_003
        peers = await averaging_peers(Hub(), n, allreduce=RING, allreduce_class=RingAllReduce)
        xs, ws = inputs(n, numel, 11), [float(i + 1) for i in range(n)]
        fresh = await asyncio.gather(*[p.round("r0", x.clone(), w, expected=n, info=RATES)
                                       for p, x, w in zip(peers, xs, ws)])
        ins = [x.clone() for x in xs]
        over = await asyncio.gather(*[p.round("r1", y, w, expected=n, info=RATES, out=y)
                                      for p, y, w in zip(peers, ins, ws)])
        for peer, y, a, b in zip(peers, ins, over, fresh):
            assert peer.allreduce.rings_run == 2
            assert a.averaged.data_ptr() == y.data_ptr() and torch.equal(a.averaged, b.averaged)

    asyncio.run(main())


def test_fp16_ring_results_are_identical_and_close_to_the_mean(averaging_peers):
    async def main():
        config = AllReduceConfig(compression="fp16", sender_timeout_s=1.0, reducer_timeout_s=3.0, chunk_numel=4096,
                                 exchange="ring")
        peers = await averaging_peers(Hub(), 4, allreduce=config, allreduce_class=RingAllReduce)
        xs = inputs(4, 30_000, 7)
        results = await asyncio.gather(*[p.round("r0", x, 2.0, expected=4, info=RATES) for p, x in zip(peers, xs)])
        reference = weighted_average(xs, [1, 1, 1, 1])
        for res in results:
            assert torch.equal(res.averaged, results[0].averaged)
        # the running mean is rounded to fp16 at each of the 3 hops and once more as the result
        assert ((results[0].averaged - reference).norm() / reference.norm()).item() < 2e-3
        assert all(p.allreduce.rings_run == 1 for p in peers)

    asyncio.run(main())


def test_zero_weights_fold_in_like_the_butterflys_mean(averaging_peers):
    async def main():
        peers = await averaging_peers(Hub(), 3, allreduce=RING, allreduce_class=RingAllReduce)
        xs = inputs(3, 9000, 3)
        mixed = await asyncio.gather(*[p.round("a", x, w, expected=3, info=RATES)
                                       for p, x, w in zip(peers, xs, [0.0, 3.0, 0.0])])
        for res in mixed:  # only the one weighted member counts
            torch.testing.assert_close(res.averaged, xs[1], rtol=1e-6, atol=1e-6)
        zero = await asyncio.gather(*[p.round("b", x, 0.0, expected=3, info=RATES) for p, x in zip(peers, xs)])
        for res in zero:  # no weight at all: zeros, as PartReducer.mean
            assert torch.equal(res.averaged, torch.zeros(9000))

    asyncio.run(main())


def _group(n: int, infos: dict) -> Group:
    members = [f"p{i}" for i in range(n)]
    return Group("g", "k", members[0], tuple(members), infos)


def _rates(*mbit: float) -> dict:
    return {f"p{i}": {"rates": {"up": r * 1.25e5, "down": r * 1.25e5}} for i, r in enumerate(mbit)}


@pytest.mark.parametrize("n, infos, numel, rings", [
    (3, _rates(100, 100, 100), 100, True),
    (3, _rates(100, 80, 100), 100, True),  # within RATE_SPREAD: the butterfly too would cut equal parts
    (2, _rates(100, 100), 100, False),  # two members: the same flows either way, the butterfly keeps its checks
    (3, _rates(100, 100, 100), 2, False),  # fewer values than members
    (3, {**_rates(100, 100, 100), "p1": {**_rates(100)["p0"], "dial_only": True}}, 100, False),  # p1 behind a NAT
    (3, _rates(100, 100, 20), 100, False),  # a slow link: bandwidth-proportional parts win
    (3, {}, 100, False),  # no rates measured yet: the butterfly runs (and measures them)
    (3, {k: v for k, v in _rates(100, 100, 100).items() if k != "p2"}, 100, False),  # p2 has not measured yet
    (3, {**_rates(100, 100, 100), "p2": {**_rates(100)["p0"], "ringed": RING_REMEASURE_RUNS - 1}}, 100, True),
    (3, {**_rates(100, 100, 100), "p2": {**_rates(100)["p0"], "ringed": RING_REMEASURE_RUNS}}, 100, False),  # due
    (3, {**_rates(100, 100, 100), "p2": {**_rates(100)["p0"], "ringed": "many"}}, 100, False),  # malformed
])
def test_the_ring_is_chosen_from_the_group_alone(n, infos, numel, rings):
    ring = RingAllReduce(SimpleNamespace(streams=None, discovery=None), "run", RING)
    assert ring.ring_fits(_group(n, infos), numel) is rings


@pytest.mark.parametrize("compression, mbit, frame", [
    ("none", 100, 122_880),  # 40 ms at 100 Mbit/s: 125,000 fp32 values, down to a multiple of 4096
    ("fp16", 20, 49_152),
    ("none", 10_000, 131_072),  # a fast link: the all-reduce's chunk_numel
    ("fp16", 0.1, 4096),  # a crawl: one block
])
def test_a_rings_frames_take_about_forty_ms_on_its_slowest_link(compression, mbit, frame):
    config = AllReduceConfig(compression=compression, exchange="ring")
    ring = RingAllReduce(SimpleNamespace(streams=None, discovery=None), "run", config)
    rates = _rates(mbit, mbit * 1.2, mbit * 1.4)
    assert ring.ring_fits(_group(3, rates), 10**6)
    assert ring.frame_numel(_group(3, rates)) == frame


def test_groups_that_do_not_fit_a_ring_run_the_butterfly(averaging_peers):
    async def main():
        peers = await averaging_peers(Hub(), 3, allreduce=RING, allreduce_class=RingAllReduce)
        xs = inputs(3, 5000, 5)
        infos = [{**RATES, "dial_only": True}, RATES, RATES]
        results = await asyncio.gather(*[p.round("r0", x, 1.0, expected=3, info=i)
                                         for p, x, i in zip(peers, xs, infos)])
        for res in results:
            assert torch.equal(res.averaged, results[0].averaged)
            torch.testing.assert_close(res.averaged, weighted_average(xs, [1, 1, 1]), rtol=1e-5, atol=1e-6)
        assert [p.allreduce.rings_run for p in peers] == [0, 0, 0]

    asyncio.run(main())


@pytest.mark.parametrize("bad", [{"aggregation": "centered_clip"}, {"compression": "int8"},
                                 {"compression": "topk"}])
def test_a_ring_needs_the_mean_and_a_float_codec(bad):
    with pytest.raises(ValueError, match="ring"):
        AllReduceConfig(**{"compression": "none", "exchange": "ring", **bad})


def test_a_member_that_never_starts_fails_the_ring_for_everyone_within_the_timeout(averaging_peers):
    async def main():
        peers = await averaging_peers(Hub(), 4, allreduce=RING, allreduce_class=RingAllReduce)
        xs = inputs(4, 20_000, 9)
        groups = await asyncio.gather(*[p.matchmaker.form_group("r0", RATES, expected_size=4) for p in peers])
        absent = groups[0].members[2]
        runs = [p.allreduce.run(g, x, 1.0) for p, g, x in zip(peers, groups, xs)
                if p.transport.streams.peer_id != absent]
        results = await asyncio.gather(*runs, return_exceptions=True)
        assert len(results) == 3 and all(isinstance(r, AllReduceFailed) for r in results), results

    asyncio.run(main())


class _CorruptRingStreams:
    """Streams whose ring calls carry 0xFF in place of every large write (a NaN in fp32): counts what it corrupted."""

    def __init__(self, inner):
        self.inner = inner
        self.corrupted = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def open(self, peer_id, name):
        reader, writer = await self.inner.open(peer_id, name)
        if not name.endswith(".ring"):
            return reader, writer
        outer = self

        class Writer:
            def __getattr__(self, attr):
                return getattr(writer, attr)

            def write(self, data):
                if len(data) >= 1024:
                    outer.corrupted += 1
                    data = b"\xff" * len(data)
                writer.write(data)

        return reader, Writer()


def test_a_member_that_sends_garbage_is_banned_by_its_neighbour_and_nobody_uses_a_result(averaging_peers):
    async def main():
        hostile = []

        def wrap(i, transport):
            if i != 1:
                return transport
            streams = _CorruptRingStreams(transport.streams)
            hostile.append(streams)
            return SimpleNamespace(discovery=transport.discovery, streams=streams)

        peers = await averaging_peers(Hub(), 3, allreduce=RING, allreduce_class=RingAllReduce, ban_s=60.0, wrap=wrap)
        xs = inputs(3, 20_000, 11)
        results = await asyncio.gather(*[p.round("r0", x, 1.0, expected=3, info=RATES) for p, x in zip(peers, xs)],
                                       return_exceptions=True)
        assert hostile[0].corrupted >= 1
        assert all(isinstance(r, AllReduceFailed) for r in results), results
        liar = peers[1].transport.streams.peer_id
        victims = [p for p in peers if p.bans.is_banned(liar)]
        assert len(victims) == 1 and "invalid ring frame" in victims[0].bans.reason(liar)

    asyncio.run(main())


def test_a_peers_first_runs_are_butterflies_that_measure_its_links_then_it_rings(averaging_peers):
    async def main():
        config = AllReduceConfig(compression="fp16", sender_timeout_s=5.0, reducer_timeout_s=10.0, exchange="ring")
        peers = await averaging_peers(Hub(), 3, allreduce=config, allreduce_class=RingAllReduce)
        numel = RATE_MIN_BYTES  # fp16: 2/3 of 2 bytes a value up and down per run, above RATE_MIN_BYTES
        for r in range(RATE_MIN_RUNS + 1):
            if r == RATE_MIN_RUNS:  # in-process "links" run at the event loop's pace: make them alike
                assert all(p.allreduce.announce().get("rates") for p in peers)  # measured by the butterflies
                for p in peers:
                    p.allreduce.rates = {"up": 1.25e7, "down": 1.25e7}
            else:  # nothing measured yet: the butterfly (which measures)
                assert not any(p.allreduce.announce().get("rates") for p in peers)
            xs = inputs(3, numel, r)
            results = await asyncio.gather(*[p.round(f"r{r}", x, 1.0, expected=3, info=p.allreduce.announce())
                                             for p, x in zip(peers, xs)])
            assert all(torch.equal(res.averaged, results[0].averaged) for res in results)
            assert [p.allreduce.rings_run for p in peers] == [int(r == RATE_MIN_RUNS)] * 3

    asyncio.run(main())


def test_after_remeasure_runs_rings_in_a_row_one_butterfly_measures_the_links_again(averaging_peers):
    async def main():
        peers = await averaging_peers(Hub(), 3, allreduce=RING, allreduce_class=RingAllReduce)
        for p in peers:
            p.allreduce.remeasure_runs = 2
            p.allreduce.rates = dict(RATES["rates"])
        patterns = []
        for r in range(5):
            xs = inputs(3, 9000, r)
            before = [p.allreduce.rings_run for p in peers]
            results = await asyncio.gather(*[p.round(f"r{r}", x, 1.0, expected=3, info=p.allreduce.announce())
                                             for p, x in zip(peers, xs)])
            assert all(torch.equal(res.averaged, results[0].averaged) for res in results)
            ran = {p.allreduce.rings_run - b for p, b in zip(peers, before)}
            assert len(ran) == 1  # every member took the same pattern
            patterns.append("ring" if ran == {1} else "butterfly")
            assert all(p.allreduce.announce()["ringed"] == p.allreduce.ringed for p in peers)
        assert patterns == ["ring", "ring", "butterfly", "ring", "ring"]

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_diloco_workers_ring_their_pseudo_gradients_and_stay_bit_identical(tmp_path):
    from peerd.config import NodeConfig
    from peerd.roles.base import RunContext
    from peerd.roles.diloco import DiLoCoRole
    from peerd.run_config import AveragingConfig, RunConfig
    from protocols.diloco import DiLoCoHyperparams

    run = RunConfig(
        model="tiny", seq_len=32, batch_size=4, eval_batches=0, max_outer_rounds=2,
        diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=2, inner_lr=1e-3),
        averaging=AveragingConfig.from_dict({
            "matchmaking": {"min_group_size": 3, "matchmaking_timeout_s": 4.0, "request_timeout_s": 1.0},
            "allreduce": {"compression": "fp16", "exchange": "ring", "sender_timeout_s": 3.0,
                          "reducer_timeout_s": 6.0}}))

    async def main():
        hub = Hub()
        workers = [DiLoCoRole(RunContext.build("unit", run, NodeConfig(checkpoint_dir=str(tmp_path / c), threads=1,
                                                                        device="cpu"), hub.transport(f"peer-{c}")))
                   for c in "abc"]
        for w in workers:  # as measured by earlier butterfly runs on links of one speed
            w.sync.allreduce.rates = dict(RATES["rates"])
        await asyncio.gather(*[w.run() for w in workers])
        assert [w.outer.outer_round for w in workers] == [2, 2, 2]
        assert len({w.outer.digest() for w in workers}) == 1
        assert [w.sync.allreduce.rings_run for w in workers] == [2, 2, 2]
        assert all(w.stats.rounds_failed == 0 for w in workers)

    asyncio.run(main())
