"""Sparse all-gather of top-k pseudo-gradients (SparseLoCo) among in-process peers: bit-identical members, the hand
computed sum, exact sizes, garbage and dead members."""

import asyncio
import contextlib

import pytest
import torch

from peerd.transport.inprocess import Hub
from protocols.allgather import SparseAllGather, vector_digest
from protocols.allreduce import AllReduceConfig, AllReduceFailed
from protocols.codecs import get_codec
from protocols.rpc import RpcError, call
from tests.streams import breaking_transport

pytestmark = pytest.mark.timeout(30)

GATHER = AllReduceConfig(compression="topk", exchange="gather", sender_timeout_s=1.0, reducer_timeout_s=2.0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _assert_close(actual, expected, rtol=1e-6, atol=1e-7):
    """Elementwise |actual - expected| <= atol + rtol |expected| (torch.testing's first call imports for ~seconds)."""
    assert actual.shape == expected.shape
    assert bool(((actual - expected).abs() <= atol + rtol * expected.abs()).all()), \
        float((actual - expected).abs().max())


def _hand_mean(xs, ws):
    """sum_j w_j decode(topk(x_j)) / sum_j w_j, computed densely in fp64 then rounded."""
    codec = get_codec("topk")
    total = sum(ws)
    acc = torch.zeros(xs[0].numel(), dtype=torch.float64)
    for x, w in zip(xs, ws):
        acc += w * codec.decode(codec.encode(x), x.numel()).double()
    return (acc / total).float()


@pytest.mark.parametrize("n", [3, 4])
def test_members_get_the_bit_identical_mean_of_the_decoded_topk_vectors(n, averaging_peers):
    async def main():
        peers = await averaging_peers(Hub(), n, allreduce=GATHER, allreduce_class=SparseAllGather)
        g = torch.Generator().manual_seed(n)
        numel = 10_000  # two full chunks and a short one
        xs = [torch.randn(numel, generator=g) for _ in range(n)]
        ws = [float(i + 1) for i in range(n)]
        results = await asyncio.gather(*[p.round("g0", x, w, expected=n) for p, x, w in zip(peers, xs, ws)])
        codec = get_codec("topk")
        for res, x in zip(results, xs):
            assert torch.equal(_bits(res.averaged), _bits(results[0].averaged))
            assert res.group_size == n and res.contributors == n and res.excluded == {}
            assert torch.equal(res.sent, codec.decode(codec.encode(x), numel))
        _assert_close(results[0].averaged, _hand_mean(xs, ws))
        # the sparse union: at most n k non-zeros
        assert int((results[0].averaged != 0).sum()) <= n * codec.kept(numel)

    asyncio.run(main())


def test_bytes_are_exactly_n_minus_1_sparse_vectors_plus_headers(averaging_peers, wait_for_order):
    async def main():
        n, numel = 4, 4096 * 20
        peers = await averaging_peers(Hub(), n, allreduce=GATHER, allreduce_class=SparseAllGather)
        results = await asyncio.gather(*[p.round("g1", torch.randn(numel), 1.0, expected=n) for p in peers])
        codec = get_codec("topk")
        size = codec.encoded_size(numel)
        assert size == len(codec.encode(torch.randn(numel)))
        assert size == 8 * 20 + 2 * codec.kept(numel) + (codec.kept(numel) + 3) // 4
        for r in results:
            # payloads are exact; each message adds one frame header (< 600 bytes with the PeerID-keyed view)
            assert (n - 1) * size <= r.bytes_sent <= (n - 1) * (size + 600), (r.bytes_sent, size)
            assert (n - 1) * size <= r.bytes_received <= (n - 1) * (size + 600), (r.bytes_received, size)
        # fp16 butterfly (parts up, answers down): 2 (n-1)/n * numel * 2 bytes; the gather is > 10x smaller here
        assert results[0].bytes_sent * 10 < 2 * (n - 1) / n * numel * 2

    asyncio.run(main())


class _Garbage(SparseAllGather):
    """Sends an invalid vector of the right size: an index beyond its chunk."""

    async def _send(self, peer, header, payload, start):
        bad = bytearray(payload)
        bad[8 * 3: 8 * 3 + 2] = (65535).to_bytes(2, "little")  # first index of chunk 0 (3 chunks of magnitudes)
        return await super()._send(peer, header, bytes(bad), start)


class _Oversized(SparseAllGather):
    async def _send(self, peer, header, payload, start):
        return await super()._send(peer, header, payload + b"\0" * 64, start)


@pytest.mark.parametrize("cheat", [_Garbage, _Oversized])
def test_a_member_sending_garbage_is_excluded_and_banned_and_the_others_agree(cheat, averaging_peers):
    async def main():
        n, numel = 4, 10_000
        peers = await averaging_peers(Hub(), n, allreduce=GATHER, ban_s=60.0,
                                      allreduce_class=lambda i: cheat if i == 3 else SparseAllGather)
        bad = peers[3].transport.streams.peer_id
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(numel, generator=g) for _ in range(n)]
        results = await asyncio.gather(*[p.round("g2", x, 1.0, expected=n) for p, x in zip(peers, xs)],
                                       return_exceptions=True)
        assert isinstance(results[3], AllReduceFailed)  # its vector was refused
        honest = results[:3]
        for res, p in zip(honest, peers):
            assert bad in res.excluded and p.bans.is_banned(bad)
            assert res.contributors == 3
            assert torch.equal(_bits(res.averaged), _bits(honest[0].averaged))
        _assert_close(honest[0].averaged, _hand_mean(xs[:3], [1.0] * 3))

    asyncio.run(main())


async def _four_with(averaging_peers, odd, at: int, seed: int):
    """Four gathering peers on one hub, member ``at`` running class ``odd``; and their inputs (10,000 floats each,
    drawn with ``seed``)."""
    peers = await averaging_peers(Hub(), 4, allreduce=GATHER,
                                  allreduce_class=lambda i: odd if i == at else SparseAllGather)
    g = torch.Generator().manual_seed(seed)
    return peers, [torch.randn(10_000, generator=g) for _ in range(4)]


class _Dies(SparseAllGather):
    """Delivers its vector to the first other member only, then vanishes (never answers anyone)."""

    async def run(self, group, tensor, weight):
        me = self.transport.streams.peer_id
        first = next(m for m in group.members if m != me)
        codec = self.codec
        header = {"group_id": group.group_id, "numel": tensor.numel(), "weight": weight, "codec": codec.name}
        with contextlib.suppress(RpcError):  # its answer does not matter: it dies right after
            await call(self.transport.streams, first, self.prefix, "gather", header, codec.encode(tensor),
                       timeout_s=0.5)
        raise AllReduceFailed("died")

    async def rpc_gather(self, request):
        await asyncio.Event().wait()  # dead: callers hear nothing until their reducer_timeout_s


def test_a_member_dying_mid_gather_leaves_the_others_bit_identical(averaging_peers):
    async def main():
        n = 4
        peers, xs = await _four_with(averaging_peers, odd=_Dies, at=3, seed=2)
        results = await asyncio.gather(*[p.round("g3", x, 1.0, expected=n) for p, x in zip(peers, xs)],
                                       return_exceptions=True)
        assert isinstance(results[3], AllReduceFailed)
        honest = results[:3]
        # one member holds the dead member's vector, the others do not: every view drops it
        dead = peers[3].transport.streams.peer_id
        assert any(dead in session.contributions for session in peers[0].allreduce._sessions.values())
        assert [res.contributors for res in honest] == [3, 3, 3]
        for res in honest:
            assert torch.equal(_bits(res.averaged), _bits(honest[0].averaged))
        _assert_close(honest[0].averaged, _hand_mean(xs[:3], [1.0] * 3))

    asyncio.run(main())


def test_a_member_dead_before_it_sent_holds_nobodys_collection_until_the_sender_timeout(averaging_peers):
    async def main():
        n = 4
        config = AllReduceConfig(compression="topk", exchange="gather", sender_timeout_s=5.0, reducer_timeout_s=10.0)
        hub = Hub()
        peers = await averaging_peers(hub, n, allreduce=config, allreduce_class=SparseAllGather, ban_s=60.0)
        g = torch.Generator().manual_seed(5)
        xs = [torch.randn(5000, generator=g) for _ in range(n)]
        dead = peers[3].transport.streams.peer_id
        group = (await asyncio.gather(*[p.matchmaker.form_group("g9", {}, expected_size=n) for p in peers]))[0]
        hub.disconnect(dead)
        loop = asyncio.get_running_loop()
        started = loop.time()
        honest = await asyncio.gather(*[p.allreduce.run(group, x, 1.0) for p, x in zip(peers[:3], xs[:3])])
        elapsed = loop.time() - started
        assert elapsed < 1.0, elapsed  # 5 s (the sender timeout) before
        assert [res.contributors for res in honest] == [3, 3, 3]
        for p, res in zip(peers, honest):
            assert torch.equal(_bits(res.averaged), _bits(honest[0].averaged))
            session = next(iter(p.allreduce._sessions.values()))
            assert session.gone == {dead} and dead not in session.excluded and not p.bans.is_banned(dead)
        _assert_close(honest[0].averaged, _hand_mean(xs[:3], [1.0] * 3))

    asyncio.run(main())


def test_a_member_whose_connection_breaks_mid_vector_is_excluded_not_banned(averaging_peers):
    # every other member loses its connection to the victim halfway through the victim's vector (a crash, a dropped
    # link, a record altered on the path): the victim is left out of their views at once, and not banned
    async def main():
        n = 4
        config = AllReduceConfig(compression="topk", exchange="gather", sender_timeout_s=5.0, reducer_timeout_s=10.0)
        hub = Hub()
        victim, fired = "peer03", []
        wrap = lambda i, t: breaking_transport(t, ".gather", victim, 1200, fired) if i != 3 else t
        peers = await averaging_peers(hub, [f"peer{i:02d}" for i in range(n)], allreduce=config,
                                      allreduce_class=SparseAllGather, ban_s=60.0, wrap=wrap)
        g = torch.Generator().manual_seed(7)
        xs = [torch.randn(50_000, generator=g) for _ in range(n)]  # a 2,357-byte vector: broken after 1,200 bytes
        group = (await asyncio.gather(*[p.matchmaker.form_group("g7", {}, expected_size=n) for p in peers]))[0]
        by_id = {p.transport.streams.peer_id: (p, x) for p, x in zip(peers, xs)}
        loop = asyncio.get_running_loop()
        started = loop.time()
        out = await asyncio.gather(*[by_id[m][0].allreduce.run(group, by_id[m][1], 1.0) for m in group.members],
                                   return_exceptions=True)
        elapsed = loop.time() - started
        assert len(fired) == 3 and elapsed < 5.0, (fired, elapsed)
        assert isinstance(out[group.members.index(victim)], AllReduceFailed)  # its vector refused by every other member
        for m in group.members:
            if m == victim:
                continue
            p = by_id[m][0]
            assert not p.bans.is_banned(victim)
            session = next(iter(p.allreduce._sessions.values()))
            assert "connection broken" in session.excluded[victim], session.excluded

    asyncio.run(main())


def test_a_member_starting_after_the_others_collected_fails_alone_and_the_others_agree(averaging_peers):
    async def main():
        n = 4
        peers, xs = await _four_with(averaging_peers, odd=SparseAllGather, at=0, seed=4)

        async def member(i):
            group = await peers[i].matchmaker.form_group("g6", {}, expected_size=n)
            if i == 0:
                await asyncio.sleep(1.5)  # past everyone's sender_timeout_s: its calls find final views
            return await peers[i].allreduce.run(group, xs[i], 1.0)

        results = await asyncio.gather(*[member(i) for i in range(n)], return_exceptions=True)
        assert isinstance(results[0], AllReduceFailed)
        for res in results[1:]:
            assert res.contributors == 3 and torch.equal(_bits(res.averaged), _bits(results[1].averaged))
        _assert_close(results[1].averaged, _hand_mean(xs[1:], [1.0] * 3))

    asyncio.run(main())


class _Equivocates(SparseAllGather):
    """Sends a different (valid) vector to the first other member than to the rest."""

    async def _send(self, peer, header, payload, start):
        group = self._sessions[header["group_id"]].group
        if peer == next(m for m in group.members if m != self.transport.streams.peer_id):
            numel = header["numel"]
            payload = self.codec.encode(torch.linspace(-1, 1, numel))
        return await super()._send(peer, header, payload, start)


def test_a_member_sending_different_vectors_is_left_out_by_everyone_itself_included(averaging_peers):
    async def main():
        n = 4
        peers, xs = await _four_with(averaging_peers, odd=_Equivocates, at=2, seed=3)
        results = await asyncio.gather(*[p.round("g4", x, 1.0, expected=n) for p, x in zip(peers, xs)])
        for res in results:
            assert res.contributors == 3
            assert torch.equal(_bits(res.averaged), _bits(results[0].averaged))
        assert torch.count_nonzero(results[2].sent) == 0  # its error feedback keeps the whole vector
        _assert_close(results[0].averaged, _hand_mean([xs[0], xs[1], xs[3]], [1.0] * 3))

    asyncio.run(main())


def test_the_digest_covers_weight_and_bytes():
    assert vector_digest(1.0, b"abc") != vector_digest(2.0, b"abc")
    assert vector_digest(1.0, b"abc") != vector_digest(1.0, b"abd")
    assert vector_digest(3, b"x") == vector_digest(3.0, b"x")


def test_gather_needs_a_sparse_codec_and_the_mean():
    with pytest.raises(ValueError, match="sparse"):
        AllReduceConfig(compression="fp16", exchange="gather")
    with pytest.raises(ValueError, match="mean"):
        AllReduceConfig(compression="topk", exchange="gather", aggregation="centered_clip")
    with pytest.raises(ValueError, match="exchange"):
        AllReduceConfig(compression="topk", exchange="scatter")


def test_the_topk_fraction_sets_the_density_and_the_exact_size(averaging_peers, wait_for_order):
    config = AllReduceConfig(compression="topk", exchange="gather", topk_fraction=0.05, sender_timeout_s=1.0,
                             reducer_timeout_s=2.0)
    codec = config.make_codec()
    assert codec.kept(8192) == 2 * 205 and codec.encoded_size(8192) == 16 + 2 * 410 + 410 // 4 + 1

    async def main():
        n, numel = 3, 8192
        peers = await averaging_peers(Hub(), n, allreduce=config, allreduce_class=SparseAllGather)
        results = await asyncio.gather(*[p.round("g5", torch.randn(numel), 1.0, expected=n) for p in peers])
        for r in results:
            assert int(torch.count_nonzero(r.sent)) <= codec.kept(numel)
            assert (n - 1) * codec.encoded_size(numel) <= r.bytes_sent <= (n - 1) * (codec.encoded_size(numel) + 600)

    asyncio.run(main())
    with pytest.raises(ValueError, match="topk_fraction"):
        AllReduceConfig(compression="topk", topk_fraction=0.0)


def _gather_run(**diloco):
    from peerd.run_config import AveragingConfig, RunConfig
    from protocols.diloco import DiLoCoHyperparams

    return RunConfig(
        model="tiny", seq_len=32, batch_size=4, eval_batches=0, max_outer_rounds=2,
        diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=2, inner_lr=1e-3, **diloco),
        averaging=AveragingConfig.from_dict({
            "matchmaking": {"min_group_size": 2, "matchmaking_timeout_s": 4.0, "request_timeout_s": 1.0},
            "allreduce": {"compression": "topk", "exchange": "gather", "sender_timeout_s": 3.0,
                          "reducer_timeout_s": 6.0}}))


@pytest.mark.timeout(120)
def test_diloco_workers_train_with_the_gather_and_sparseloco_outer_step_bit_identically(tmp_path):
    from peerd.config import NodeConfig
    from peerd.roles.base import RunContext
    from peerd.roles.diloco import DiLoCoRole

    async def main():
        hub = Hub()
        run = _gather_run(outer_momentum=0.0, outer_lr=1.0, error_feedback_decay=0.95)
        workers = [DiLoCoRole(RunContext.build("unit", run, NodeConfig(checkpoint_dir=str(tmp_path / c), threads=1,
                                                                        device="cpu"), hub.transport(f"peer-{c}")))
                   for c in "ab"]
        theta0 = workers[0].outer.theta.clone()
        await asyncio.gather(*[w.run() for w in workers])
        assert [w.outer.outer_round for w in workers] == [2, 2]
        assert len({w.outer.digest() for w in workers}) == 1 and not torch.equal(workers[0].outer.theta, theta0)
        for w in workers:
            assert isinstance(w.sync.allreduce, SparseAllGather)
            assert w.sync.feedback.decay == 0.95 and float(w.sync.feedback.error.abs().sum()) > 0
            assert w.stats.rounds_failed == 0

    asyncio.run(main())


def test_gather_config_is_validated_and_fingerprint_neutral_at_its_defaults():
    from peerd.config import ConfigError
    from peerd.run_config import AveragingConfig, RunConfig
    from protocols.diloco import DiLoCoHyperparams

    base = RunConfig(model="tiny")
    same = RunConfig(model="tiny", diloco=DiLoCoHyperparams(error_feedback_decay=1.0),
                     averaging=AveragingConfig.from_dict({"allreduce": {"exchange": "reduce", "topk_fraction": 0.02}}))
    assert same.fingerprint() == base.fingerprint()
    assert _gather_run().fingerprint() != _gather_run(error_feedback_decay=0.95).fingerprint()
    parsed = RunConfig.from_dict({"averaging": {"allreduce": {"compression": "topk", "exchange": "gather"}}})
    assert parsed.averaging.allreduce().exchange == "gather"
    with pytest.raises(ConfigError, match="sparse"):
        RunConfig.from_dict({"averaging": {"allreduce": {"compression": "fp16", "exchange": "gather"}}})
    with pytest.raises(ConfigError, match="topk"):  # the mixing methods average outer states, not deltas
        RunConfig.from_dict({"averaging": {"method": "gossip", "gossip": {"compression": "topk"},
                                           "allreduce": {"compression": "topk", "exchange": "gather"}}})
    with pytest.raises(ValueError, match="error_feedback_decay"):
        DiLoCoHyperparams(error_feedback_decay=1.5)
