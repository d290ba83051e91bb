"""A peer behind a NAT in an averaging round: it announces ``dial_only``, leads no group and reduces no part, so
every stream of its round is one it opens itself (others could reach it only through a relay, or not at all)."""

import asyncio
import types

import pytest
import torch

from peerd.transport.dialback import helpers_for
from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceConfig, ButterflyAllReduce
from protocols.matchmaking import Group, MatchmakingConfig
from tests.streams import StreamsWrapper

pytestmark = pytest.mark.timeout(60)

MM = MatchmakingConfig(3.0, 0.5, 0.05)
CFG = AllReduceConfig(compression="none", sender_timeout_s=5.0, reducer_timeout_s=10.0, chunk_numel=4096)


def test_dial_only_members_reduce_nothing_while_another_member_can():
    ar = ButterflyAllReduce(Hub().transport("a"), "run", CFG)
    members = ("a", "b", "c", "d")

    def group(infos):
        return Group("g", "k", "a", members, infos)

    assert ar.part_sizes(group({"a": {"dial_only": True}}), 12) == [0, 4, 4, 4]
    assert ar.part_sizes(group({"a": {"dial_only": True}, "c": {"dial_only": True}}), 10) == [0, 5, 0, 5]
    every = {m: {"dial_only": True} for m in members}
    assert ar.part_sizes(group(every), 12) == [3, 3, 3, 3]  # nobody else could: equal parts, through the relays
    assert ar.part_sizes(group({"a": {"dial_only": "yes"}, "b": {"dial_only": 1}}), 12) == [3, 3, 3, 3]  # not True
    # the others' parts stay bandwidth-proportional among themselves
    rates = {m: {"rates": {"up": r, "down": r}} for m, r in zip(members, (100, 100, 100, 1))}
    rates["b"]["dial_only"] = True
    others = ar.part_sizes(Group("g", "k", "a", ("a", "c", "d"), {m: rates[m] for m in "acd"}), 4096 * 8)
    assert others[2] < others[0] == others[1]  # d is slow: proportional, not equal
    assert ar.part_sizes(group(rates), 4096 * 8) == [others[0], 0, others[1], others[2]]
    ar.dial_only = True
    assert ar.announce() == {"dial_only": True}
    ar.rates = {"up": 1.0, "down": 2.0}
    assert ar.announce() == {"rates": {"up": 1.0, "down": 2.0}, "dial_only": True}


class _Nat(StreamsWrapper):
    """Streams of a reachable peer that cannot open a stream to ``nated`` (it sits behind a NAT): counts the tries."""

    def __init__(self, inner, nated: str):
        self.inner, self.nated, self.tries = inner, nated, 0

    async def open(self, peer_id, name):
        if peer_id == self.nated:
            self.tries += 1
            raise ConnectionError(f"cannot dial {peer_id}: behind a NAT")
        return await self.inner.open(peer_id, name)


def test_a_dial_only_peer_with_the_smallest_peer_id_follows_and_the_round_needs_no_stream_to_it(averaging_peers):
    """peer00 would lead (smallest PeerID) and reduce a quarter; nobody can dial it. As dial-only it joins peer01's
    group and sends its parts; the mean is exact on every member and nobody even tried to dial it."""
    async def main():
        hub = Hub()
        nats = []

        def behind(i, transport):
            if i == 0:
                return transport
            wrapped = types.SimpleNamespace(discovery=transport.discovery, streams=_Nat(transport.streams, "peer00"))
            nats.append(wrapped.streams)
            return wrapped

        peers = await averaging_peers(hub, 4, "run", MM, CFG, wrap=behind)
        peers[0].allreduce.dial_only = True  # announced in the group info: the matchmaker reads it there
        groups = await asyncio.gather(*[p.matchmaker.form_group("r", p.allreduce.announce(), expected_size=4)
                                        for p in peers])
        assert {g.members for g in groups} == {("peer00", "peer01", "peer02", "peer03")}
        assert {g.leader for g in groups} == {"peer01"}
        group, by_id = groups[0], {p.matchmaker.peer_id: p for p in peers}
        xs = {m: torch.randint(-50, 50, (4 * 4096,), generator=torch.Generator().manual_seed(i)).float()
              for i, m in enumerate(group.members)}
        started = asyncio.get_running_loop().time()
        out = await asyncio.gather(*[by_id[m].allreduce.run(group, xs[m], 1.0) for m in group.members])
        assert all(torch.equal(r.averaged, sum(xs.values()) / 4) for r in out)
        # nobody sends to an empty part, and its reducer does not wait for the sender timeout (5 s) to seal it
        assert asyncio.get_running_loop().time() - started < CFG.sender_timeout_s / 2
        assert not any(r.late for r in out)
        assert out[0].part_sizes[0] == 0 and sum(out[0].part_sizes) == 4 * 4096
        assert sum(n.tries for n in nats) == 0  # no stream was ever opened towards the NATed peer

        # the control: without dial_only it leads, and the others' joins to it fail
        hub = Hub()
        nats.clear()
        peers = await averaging_peers(hub, 3, "run", MatchmakingConfig(1.0, 0.3, 0.05), CFG, wrap=behind)
        await asyncio.gather(*[p.matchmaker.form_group("r", {}, expected_size=3) for p in peers],
                             return_exceptions=True)
        assert sum(n.tries for n in nats) >= 2

    asyncio.run(main())


def test_peers_found_unreachable_do_not_check_others_reachability():
    class Discovery:
        async def get(self, key):
            now = 1e12
            return {p: types.SimpleNamespace(value=value, expiration_time=now) for p, value in records.items()}

    from peerd.status.records import dialable_peers, make_status

    records = {
        "12D3KooWreach": make_status(role="diloco", outer_round=1, reachable=True),
        "12D3KooWnated": make_status(role="diloco", outer_round=1, reachable=False),
        "12D3KooWunknown": make_status(role="diloco", outer_round=1, reachable=None),
    }
    node = types.SimpleNamespace(initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWboot"])
    helpers = asyncio.run(helpers_for(node, dialable_peers(Discovery(), "status")))
    assert helpers[0] == "12D3KooWboot" and sorted(helpers[1:]) == ["12D3KooWreach", "12D3KooWunknown"]


class _Behind:
    """A transport whose streams cannot reach ``nated`` (see :class:`_Nat`); everything else is the inner one's."""

    def __init__(self, inner, nated: str):
        self._inner, self.streams = inner, _Nat(inner.streams, nated)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("method", ["allreduce", "moshpit", "gossip"])
def test_diloco_workers_average_with_a_worker_found_unreachable_without_dialing_it(method, tmp_path):
    """Three DiLoCo workers; ``peer-a`` (the smallest PeerID: it would lead) is behind a NAT: the others' streams to
    it fail, and its dial-back verdict says not reachable. Its round still averages with both (all-reduce and
    moshpit: one group of 3, the same theta_outer on all; gossip: it starts exchanges and the others mix its state)
    and nobody tried to dial it."""
    from peerd.config import NodeConfig
    from peerd.roles.base import RunContext
    from peerd.roles.diloco import DiLoCoRole
    from peerd.run_config import AveragingConfig, RunConfig
    from protocols.diloco import DiLoCoHyperparams

    async def main():
        run = RunConfig(
            model="tiny", seq_len=32, batch_size=4, eval_batches=0,
            diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=2, inner_lr=1e-3),
            averaging=AveragingConfig.from_flat(method=method, group_size=4, matchmaking_timeout_s=3.0,
                                                request_timeout_s=1.0, sender_timeout_s=3.0, reducer_timeout_s=6.0),
        )
        hub, nats = Hub(), []
        workers = []
        for name in ("peer-a", "peer-b", "peer-c"):
            transport = hub.transport(name)
            if name != "peer-a":
                transport = _Behind(transport, "peer-a")
                nats.append(transport.streams)
            node = NodeConfig(checkpoint_dir=str(tmp_path / name), threads=1, device="cpu")
            workers.append(DiLoCoRole(RunContext.build("unit", run, node, transport)))
        workers[0].ctx.status.reachable = False
        for w in workers:
            for component in w.components:
                await component.start()
            await w.publish_status()
        for w in workers:
            await w.train_until_quota()
        await asyncio.gather(*(w.run_round() for w in workers))
        return workers, nats

    workers, nats = asyncio.run(main())
    assert sum(n.tries for n in nats) == 0
    assert [w.outer.outer_round for w in workers] == [1, 1, 1]
    if method == "gossip":
        assert workers[0].sync.gossip.served == 0 and workers[0].sync.gossip.bytes_sent > 0
        assert sum(w.sync.gossip.served for w in workers[1:]) >= 1  # peer-a's exchanges were answered
    else:
        assert len({w.outer.digest() for w in workers}) == 1
        assert all(w.stats.rounds_ok == 1 and w.stats.rounds_failed == 0 for w in workers)


def test_a_member_that_reduces_nothing_still_measures_its_link_from_the_answers(averaging_peers):
    """A dial-only member reduces no part: its download is the answers of the others' parts. Counted, its rates are
    measured and announced like anyone's (uncounted, they stayed unmeasured: a peer that once got no part never
    measured its link again)."""
    from protocols.allreduce import RATE_MIN_BYTES, RATE_MIN_RUNS

    async def main():
        cfg = AllReduceConfig(compression="none", sender_timeout_s=30.0, reducer_timeout_s=60.0, chunk_numel=65536)
        peers = await averaging_peers(Hub(), 3, "run", MM, cfg)
        peers[0].allreduce.dial_only = True
        numel = RATE_MIN_BYTES // 2  # a reducer's slice of the other reducer's part is RATE_MIN_BYTES
        for rnd in range(RATE_MIN_RUNS):
            groups = await asyncio.gather(*[p.matchmaker.form_group(f"r{rnd}", p.allreduce.announce(), expected_size=3)
                                            for p in peers])
            group, by_id = groups[0], {p.matchmaker.peer_id: p for p in peers}
            out = await asyncio.gather(*[by_id[m].allreduce.run(group, torch.full((numel,), float(i)), 1.0)
                                         for i, m in enumerate(group.members)])
            assert out[0].part_sizes[group.members.index(peers[0].matchmaker.peer_id)] == 0
            assert all(torch.equal(r.averaged, torch.full((numel,), 1.0)) for r in out)
        for p in peers:
            assert p.allreduce.rates is not None and min(p.allreduce.rates.values()) > 0
        assert peers[0].allreduce.announce() == {"rates": peers[0].allreduce.rates, "dial_only": True}

    asyncio.run(main())
