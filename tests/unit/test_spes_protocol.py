"""SPES pure decisions: expert claims (coverage, balance, joins, leaves, min_holders, small peers) and the
expert-merging warm-up."""

import pytest
import torch

from protocols.spes import (PeerClaim, SpesConfig, claim_experts, expert_capacity, fair_shares, holders_of,
                            merge_alpha, merge_due, merge_experts)

pytestmark = pytest.mark.timeout(60)

BIG = 10**6


def settle(peers, n_experts, claims=None, min_holders=1, experts_per_peer=0, sweeps=6):
    """Every peer re-claims in turn from what the others hold, as each does at a sync, until nothing changes."""
    claims = dict(claims or {})
    for _ in range(sweeps):
        changed = False
        for me, capacity in sorted(peers.items()):
            others = {p: PeerClaim(frozenset(claims.get(p, ())), peers[p]) for p in peers if p != me and p in claims}
            mine = claim_experts(me, n_experts, others, capacity, min_holders, experts_per_peer, claims.get(me, ()))
            changed |= mine != claims.get(me)
            claims[me] = mine
        if not changed:
            return claims
    raise AssertionError(f"claims did not settle: {claims}")


def counts(claims, n_experts):
    return [len(h) for h in holders_of(claims, n_experts)]


@pytest.mark.parametrize("n_peers", range(1, 9))
def test_sequential_joins_cover_every_expert_in_balance(n_peers):
    peers, claims = {}, {}
    for i in range(n_peers):  # one joins, the swarm settles, the next joins
        peers[f"peer{i}"] = BIG
        claims = settle(peers, 16, claims)
    held = counts(claims, 16)
    assert min(held) >= 1  # coverage
    sizes = sorted(len(c) for c in claims.values())
    assert sizes[-1] - sizes[0] <= 1 and sum(sizes) == 16
    assert sizes[-1] == -(-16 // n_peers)  # nobody trains more than its fair share


@pytest.mark.parametrize("n_peers", [2, 3, 4, 8])
def test_min_holders_two_keeps_every_expert_on_two_peers(n_peers):
    peers = {f"p{i}": BIG for i in range(n_peers)}
    claims = settle(peers, 8, min_holders=2)
    held = counts(claims, 8)
    assert min(held) >= 2 and max(held) - min(held) <= 1
    assert all(len(c) <= -(-16 // n_peers) for c in claims.values())


def test_simultaneous_claims_from_an_empty_view_then_rebalance():
    # four peers join at once: each saw nobody and claimed everything; the next syncs spread them out
    peers = {f"p{i}": BIG for i in range(4)}
    claims = {p: frozenset(range(16)) for p in peers}
    claims = settle(peers, 16, claims)
    assert counts(claims, 16) == [1] * 16 and all(len(c) == 4 for c in claims.values())


def test_a_leavers_experts_are_reclaimed_first_and_the_rest_stays():
    peers = {f"p{i}": BIG for i in range(4)}
    claims = settle(peers, 16)
    left = claims.pop("p2")
    del peers["p2"]
    before = dict(claims)
    claims = settle(peers, 16, claims)
    assert min(counts(claims, 16)) == 1 and all(e in set().union(*claims.values()) for e in left)
    assert all(before[p] <= claims[p] for p in claims)  # survivors keep their experts and optimizer state
    assert sorted(len(c) for c in claims.values()) == [5, 5, 6]


def test_small_memory_peer_takes_fewer_and_the_others_cover_the_rest():
    peers = {"big0": BIG, "big1": BIG, "tiny": 1}
    claims = settle(peers, 12)
    assert len(claims["tiny"]) == 1 and min(counts(claims, 12)) == 1
    assert sorted([len(claims["big0"]), len(claims["big1"])]) == [5, 6]
    # no memory at all: trains only shared parameters
    assert claim_experts("z", 4, {}, 0) == frozenset()
    # alone with room for 3 of 8: takes 3, leaving 5 uncovered rather than exceeding its memory
    assert len(claim_experts("z", 8, {}, 3)) == 3


def test_claims_of_unknown_experts_are_ignored():
    others = {"bad": PeerClaim(frozenset({-1, 99}), BIG)}
    assert len(claim_experts("me", 4, others, BIG)) == 2  # the bad peer still counts for the fair share
    assert holders_of({"bad": {-1, 99}, "ok": {0}}, 2) == [["ok"], []]


def test_experts_per_peer_caps_a_claim():
    peers = {f"p{i}": BIG for i in range(2)}
    claims = settle(peers, 16, experts_per_peer=4)
    assert all(len(c) == 4 for c in claims.values()) and sum(counts(claims, 16)) == 8


def test_fair_shares_and_capacity():
    assert fair_shares(16, {"a": BIG, "b": BIG, "c": BIG, "d": BIG}, 1) == {"a": 4, "b": 4, "c": 4, "d": 4}
    assert fair_shares(12, {"a": BIG, "b": BIG, "c": 1}, 1) == {"a": 6, "b": 5, "c": 1}
    assert fair_shares(8, {"a": 2, "b": 2}, 1) == {"a": 2, "b": 2}  # not enough memory: everyone at capacity
    assert fair_shares(8, {"a": BIG}, 3) == {"a": 8}  # never more holders than peers
    assert expert_capacity(1000, 400, 100) == 6 and expert_capacity(100, 400, 100) == 0
    with pytest.raises(ValueError):
        expert_capacity(1, 1, 0)


def test_merge_alpha_decays_linearly_to_zero_and_merging_stops():
    cfg = SpesConfig(merge_interval=500, merge_decay_steps=10000, alpha_0=0.01)
    assert merge_alpha(0, 0.01, 10000) == 0.01
    assert merge_alpha(5000, 0.01, 10000) == pytest.approx(0.005)
    assert merge_alpha(10000, 0.01, 10000) == 0.0 and merge_alpha(20000, 0.01, 10000) == 0.0
    assert [s for s in range(0, 12001, 250) if merge_due(s, cfg)] == list(range(500, 10000, 500))
    assert not merge_due(500, SpesConfig(merge_interval=0))


def test_merge_update_matches_a_hand_computation():
    # 4 experts in one layer: cosine similarity on the rows themselves
    theta = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    merged = merge_experts(theta, alpha=0.5, top_k=1)
    # nearest neighbours: 0<->1, 2<->3; theta_e + 0.5 * (theta_j - theta_e) is the midpoint
    expected = torch.tensor([[0.95, 0.05], [0.95, 0.05], [0.05, 0.95], [0.05, 0.95]])
    torch.testing.assert_close(merged, expected)
    # top_k=2 for expert 0: neighbours 1 and 3 (cos 0.994 and 0.110 > cos to 2 = 0)
    two = merge_experts(theta, alpha=0.1, top_k=2)
    hand = theta[0] + 0.1 * ((theta[1] - theta[0]) + (theta[3] - theta[0])) / 2
    torch.testing.assert_close(two[0], hand)
    # similarity measured on another matrix (w1) picks the neighbours, the update moves theta
    w1 = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    by_w1 = merge_experts(theta, alpha=1.0, top_k=1, similarity_on=w1)
    torch.testing.assert_close(by_w1[0], theta[2]) and torch.testing.assert_close(by_w1[1], theta[3])
    assert torch.equal(merge_experts(theta, 0.0, 4), theta)
    assert torch.equal(merge_experts(theta[:1], 0.5, 4), theta[:1])  # a single expert has no neighbour
    with pytest.raises(ValueError):
        merge_experts(theta.reshape(-1), 0.5, 1)


def test_config_validation():
    assert SpesConfig().sync_steps == 100
    for bad in (dict(sync_steps=0), dict(min_holders=0), dict(alpha_0=2.0), dict(merge_interval=-1),
                dict(alpha_0=float("nan")), dict(experts_per_peer=True)):
        with pytest.raises(ValueError):
            SpesConfig(**bad)


def test_claim_records_round_trip_and_bad_ones_are_dropped():
    from protocols.spes import claim_record, parse_claim

    assert parse_claim(claim_record({3, 1}, 4, 7), 8) == (PeerClaim(frozenset({1, 3}), 4), 7)
    assert parse_claim(claim_record({3, 1}, 4, 7, left=True), 8) is None
    for bad in (None, [], {"experts": [8], "capacity": 1, "outer_round": 0},
                {"experts": [1, 1], "capacity": 1, "outer_round": 0}, {"experts": [1], "capacity": -1, "outer_round": 0},
                {"experts": [True], "capacity": 1, "outer_round": 0}, {"experts": "1", "capacity": 1, "outer_round": 0},
                {"experts": [1], "capacity": 1}):
        assert parse_claim(bad, 8) is None, bad


@pytest.mark.parametrize("n_peers", range(1, 9))
@pytest.mark.parametrize("min_holders", [1, 2])
def test_rebalance_from_any_start_settles_covered_and_balanced(n_peers, min_holders):
    from protocols.spes import rebalance

    g = torch.Generator().manual_seed(n_peers * 10 + min_holders)
    for trial in range(20):
        start = {f"p{i}": PeerClaim(frozenset(int(e) for e in torch.randperm(16, generator=g)[:int(torch.randint(
            0, 17, (1,), generator=g))]), BIG) for i in range(n_peers)}
        out = rebalance(16, start, min_holders)
        held = counts(out, 16)
        assert min(held) == min(min_holders, n_peers) and max(held) - min(held) <= 1, (trial, out)
        sizes = sorted(len(c) for c in out.values())
        assert sizes[-1] - sizes[0] <= 1
        assert rebalance(16, {p: PeerClaim(c, BIG) for p, c in out.items()}, min_holders) == out  # a fixed point
