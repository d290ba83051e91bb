"""SPES sparse sync among 4 in-process peers: shared parameters = the all-peer weighted average, every copy of an
expert = the weighted average of its holders' trained copies, and only trained parameters go through the
all-reduce."""

import asyncio

import pytest
import torch

from peerd.models.moe import MoEConfig, MoETransformer
from peerd.identity.namespace import RunNamespace, RunRef
from peerd.roles.spes_sync import SparseSync
from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceConfig
from protocols.bans import BanList
from protocols.group_keys import RETRIES_FIELD
from protocols.matchmaking import Matchmaker, MatchmakingConfig, MatchmakingFailed
from protocols.spes import PeerClaim, holders_of

pytestmark = pytest.mark.timeout(120)

MM = MatchmakingConfig(matchmaking_timeout_s=5.0, request_timeout_s=2.0, poll_interval_s=0.05)
AR = AllReduceConfig(compression="none", sender_timeout_s=2.0, reducer_timeout_s=4.0)
CLAIMS = {"peer0": {0, 1, 2, 3}, "peer1": {2, 3, 4, 5}, "peer2": {4, 5, 6, 7}, "peer3": {6, 7, 0, 1, 3}}
WEIGHTS = {"peer0": 1.0, "peer1": 2.0, "peer2": 3.0, "peer3": 4.0}


def model():
    return MoETransformer(MoEConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, mlp_hidden=48, n_experts=8,
                                    top_k=2), seed=0)


def test_sparse_sync_averages_shared_with_all_and_each_expert_with_its_holders():
    async def main():
        hub = Hub()
        ns = RunNamespace(run=RunRef.parse("spes-test"))
        syncs = {}
        for i, (name, own) in enumerate(CLAIMS.items()):
            m = model()
            g = torch.Generator().manual_seed(100 + i)
            with torch.no_grad():  # "training": every copy drifts; untrained copies are stale garbage
                for p in m.parameters():
                    p.add_(torch.randn(p.shape, generator=g))
            s = SparseSync(hub.transport(name), ns, "spes", m, own, MM, AR, bans=BanList(60.0), refresh_timeout_s=10)
            await s.start()
            syncs[name] = s
        before = {n: {"shared": s.shared.flatten(s.model), **{e: s.experts[e].flatten(s.model) for e in range(8)}}
                  for n, s in syncs.items()}
        holders = holders_of(CLAIMS, 8)
        reports = dict(zip(syncs, await asyncio.gather(
            *[s.sync(0, len(syncs), WEIGHTS[n], capacity=5) for n, s in syncs.items()])))
        for n, r in reports.items():
            assert not r.failed, (n, r.failed)
            assert sorted(r.refreshed) == sorted(set(range(8)) - CLAIMS[n])
            # every member read the same claims from the shared group
            assert r.claims == {m: PeerClaim(frozenset(c), 5) for m, c in CLAIMS.items()}

        total = sum(WEIGHTS.values())
        shared = sum(WEIGHTS[n] * before[n]["shared"] for n in syncs) / total
        first = next(iter(syncs.values()))
        for n, s in syncs.items():
            got = s.shared.flatten(s.model)
            torch.testing.assert_close(got, shared, rtol=1e-5, atol=1e-6)
            assert torch.equal(got, first.shared.flatten(first.model))  # bit-identical everywhere
        for e in range(8):
            hs = holders[e]
            expected = sum(WEIGHTS[h] * before[h][e] for h in hs) / sum(WEIGHTS[h] for h in hs)
            copies = [s.experts[e].flatten(s.model) for s in syncs.values()]
            torch.testing.assert_close(copies[0], expected, rtol=1e-5, atol=1e-6)
            assert all(torch.equal(c, copies[0]) for c in copies), e

        # bytes: a butterfly member sends (n-1)/n of each trained fragment to the reducers and its reduced part
        # back to n-1 members; frozen experts never enter the all-reduce
        for n, s in syncs.items():
            r = reports[n]
            frags = [(s.shared, len(syncs))] + [(s.experts[e], len(holders[e])) for e in CLAIMS[n]]
            payload = sum(2 * 4 * f.numel(s.model) * (k - 1) / k for f, k in frags)
            assert payload <= r.allreduce_bytes_sent <= payload * 1.02 + 1024 * len(frags), (n, r)
            assert r.allreduce_bytes_sent < 2 * 4 * s.trained_numel()
            untrained = sum(s.experts[e].numel(s.model) for e in set(range(8)) - CLAIMS[n])
            assert r.refresh_bytes_received >= 4 * untrained
            assert r.group_sizes["shared"] == 4 and all(r.group_sizes[f"expert{e}"] == len(holders[e])
                                                        for e in CLAIMS[n])
        for s in syncs.values():
            await s.stop()

    asyncio.run(main())


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_a_sole_holder_keeps_its_copy_and_the_others_refresh_from_it(compression):
    ar = AllReduceConfig(compression=compression, sender_timeout_s=2.0, reducer_timeout_s=4.0)

    async def main():
        hub = Hub()
        ns = RunNamespace(run=RunRef.parse("spes-test"))
        claims = {"a": set(range(8)), "b": set()}  # b has no memory for experts: shared only
        syncs = {}
        for i, (name, own) in enumerate(claims.items()):
            m = model()
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(float(i))
            syncs[name] = SparseSync(hub.transport(name), ns, "spes", m, own, MM, ar, refresh_timeout_s=10)
            await syncs[name].start()
        a_experts = [syncs["a"].experts[e].flatten(syncs["a"].model) for e in range(8)]
        reports = await asyncio.gather(*[s.sync(3, 2, 1.0) for s in syncs.values()])
        assert reports[0].group_sizes == {"shared": 2, **{f"expert{e}": 1 for e in range(8)}}
        assert sorted(reports[1].refreshed) == list(range(8)) and not reports[1].failed
        expert_numel = sum(syncs["a"].experts[e].numel(syncs["a"].model) for e in range(8))
        assert reports[1].refresh_bytes_received == (2 if compression == "fp16" else 4) * expert_numel
        for e in range(8):
            if compression == "fp16":  # a sole holder's copy is rounded as an all-reduce would round it
                torch.testing.assert_close(syncs["a"].experts[e].flatten(syncs["a"].model), a_experts[e],
                                           rtol=2**-10, atol=1e-7)
                a_experts[e] = syncs["a"].experts[e].flatten(syncs["a"].model)
            assert torch.equal(syncs["a"].experts[e].flatten(syncs["a"].model), a_experts[e])
            assert torch.equal(syncs["b"].experts[e].flatten(syncs["b"].model), a_experts[e])
        for s in syncs.values():
            await s.stop()

    asyncio.run(main())


def test_a_round_whose_shared_matchmaking_failed_is_tried_again_under_the_key_the_peers_agree_on(monkeypatch):
    keys: list[tuple[str, str]] = []  # (peer, key) of every matchmaking
    injected = []
    form_group = Matchmaker.form_group

    async def recording(self, key, *args, **kwargs):
        keys.append((self.peer_id, key))
        if self.peer_id == "a" and not injected:
            injected.append(key)
            raise MatchmakingFailed("injected")
        return await form_group(self, key, *args, **kwargs)

    monkeypatch.setattr(Matchmaker, "form_group", recording)

    async def main():
        hub = Hub()
        ns = RunNamespace(run=RunRef.parse("spes-test"))
        claims = {"a": set(range(4)), "b": set(range(4, 8))}  # sole holders: only the shared group matchmakes
        syncs = {n: SparseSync(hub.transport(n), ns, "spes", model(), own, MM, AR, refresh_timeout_s=10)
                 for n, own in claims.items()}
        for s in syncs.values():
            await s.start()
        failed = await syncs["a"].sync(0, 2, 1.0)
        assert "shared" in failed.failed and injected == ["round1"]
        assert syncs["a"].tries.record(0) == [0, 1] and syncs["a"].tries.record(1) is None
        # b did not see the failure itself: a's status record tells it which try to join
        records = {"a": {RETRIES_FIELD: {"shared": syncs["a"].tries.record(0)}}}
        reports = await asyncio.gather(syncs["a"].sync(0, 2, 1.0), syncs["b"].sync(0, 2, 1.0, records=records))
        assert all(not r.failed and r.group_sizes["shared"] == 2 for r in reports), reports
        assert keys[0] == ("a", "round1") and sorted(keys[1:]) == [("a", "round1.retry1"), ("b", "round1.retry1")]
        assert torch.equal(syncs["a"].shared.flatten(syncs["a"].model), syncs["b"].shared.flatten(syncs["b"].model))
        for s in syncs.values():
            await s.stop()

    asyncio.run(main())


def test_refresh_plan_asks_the_holder_with_most_missing_experts_first():
    from peerd.roles.spes_sync import refresh_plan

    assert refresh_plan({0: ["b", "c"], 1: ["c"], 2: ["a"], 3: []}) == ["c", "a"]
    assert refresh_plan({0: ["b"], 1: ["a"]}) == ["a", "b"]  # equals: lowest PeerID first
    assert refresh_plan({}) == []


def test_a_member_that_joined_with_a_malformed_claim_syncs_no_expert():
    from protocols.matchmaking import Group
    from protocols.spes import claim_record

    s = SparseSync(Hub().transport("a"), RunNamespace(run=RunRef.parse("spes-test")), "spes", model(), {0}, MM, AR)
    group = Group("g", "round0", "a", ("a", "b", "c"),
                  {"a": claim_record({0}, 2, 0), "b": {"experts": [0, 99], "capacity": 2, "outer_round": 0},
                   "c": "not a claim"})
    assert s._member_claims(group) == {"a": PeerClaim(frozenset({0}), 2), "b": PeerClaim(frozenset(), 0),
                                       "c": PeerClaim(frozenset(), 0)}
