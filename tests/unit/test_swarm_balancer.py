import random

import pytest

from protocols.swarm import (
    NoServer, StageBalancer, SwarmConfig, Wiring, bottleneck_stage, choose_stage, rebalance_delay_s, should_move,
    stage_throughputs,
)

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def simulate(balancer: StageBalancer, speed: dict[str, float], steps: int, rng: random.Random) -> dict[str, int]:
    work = {s: 0 for s in speed}
    for _ in range(steps):
        server = balancer.choose(1.0)
        work[server] += 1
        balancer.report(server, 1.0, rng.uniform(0.9, 1.1) / speed[server])
    return work


def test_half_speed_server_gets_a_third_of_its_stage():
    rng = random.Random(0)
    balancer = StageBalancer(ema_alpha=0.2)
    balancer.set_servers(["fast", "slow"])
    work = simulate(balancer, {"fast": 2.0, "slow": 1.0}, 600, rng)
    share = work["slow"] / 600
    assert abs(share - 1 / 3) <= 0.10, work
    assert balancer.throughput("fast") == pytest.approx(2.0, rel=0.15)


def test_equal_servers_share_equally_and_unmeasured_go_first():
    balancer = StageBalancer()
    balancer.set_servers(["a", "b", "c"])
    first = [balancer.choose() for _ in range(3)]
    assert sorted(first) == ["a", "b", "c"]  # nobody measured yet: each is tried once
    for s in "abc":
        balancer.report(s, 1.0, 1.0)
    work = simulate(balancer, {"a": 1.0, "b": 1.0, "c": 1.0}, 300, random.Random(1))
    assert all(90 <= n <= 110 for n in work.values()), work
    balancer.set_servers(["a", "b", "c", "d"])
    assert balancer.choose() == "d"  # a newcomer is measured first
    balancer.report("d", 1.0, 1.0)
    # the newcomer starts at the others' queue, not at zero: no burst of catch-up work
    work = simulate(balancer, {s: 1.0 for s in "abcd"}, 40, random.Random(2))
    assert work["d"] <= 15, work


def test_failed_server_is_banned_for_a_while_then_returns():
    clock = Clock()
    balancer = StageBalancer(ban_s=10.0, clock=clock)
    balancer.set_servers(["a", "b"])
    for s in "ab":
        balancer.report(s, 1.0, 1.0)
    balancer.fail("a", "timeout")
    assert {balancer.choose() for _ in range(10)} == {"b"}
    with pytest.raises(NoServer):
        balancer.choose(exclude=["b"])
    clock.t = 11.0
    assert "a" in {balancer.choose() for _ in range(4)}


def test_servers_that_leave_are_forgotten():
    balancer = StageBalancer()
    balancer.set_servers(["a", "b"])
    balancer.set_servers(["b"])
    assert balancer.servers == ["b"] and balancer.choose() == "b"
    balancer.report("a", 1.0, 1.0)  # a late report from a gone server is ignored
    assert balancer.throughput("a") is None
    wiring = Wiring(2)
    wiring.set_servers({0: ["x"], 1: ["y"]})
    wiring.fail(1, "y", "refused")
    assert wiring.stats.failures_by_server == {"y": 1}
    with pytest.raises(NoServer):
        wiring.stages[1].choose()


def rebalance(assignment: dict[str, int], throughput: dict[str, float], num_stages: int, periods: int) -> int:
    moves = 0
    for _ in range(periods):
        for server in sorted(assignment):
            target = should_move(server, assignment, throughput, num_stages)
            if target is not None:
                assignment[server] = target
                moves += 1
    return moves


def test_three_plus_one_ends_at_two_plus_two_and_stays():
    assignment = {"a": 0, "b": 0, "c": 0, "d": 1}
    throughput = dict.fromkeys(assignment, 1.0)
    assert bottleneck_stage(assignment, throughput, 2) == 1
    moves = rebalance(assignment, throughput, 2, periods=5)
    assert moves == 1
    assert sorted(assignment.values()) == [0, 0, 1, 1]
    assert stage_throughputs(assignment, throughput, 2) == [2.0, 2.0]


def test_move_only_if_the_bottleneck_improves_enough():
    # stage 0 = 2.2, stage 1 = 1.9; moving c gives min(2.0, 2.1) = 2.0: 1.9 / 2.0 = 0.95 >= 0.75 -> stay
    assert should_move("c", {"a": 0, "b": 0, "c": 0, "d": 1}, {"a": 1.0, "b": 1.0, "c": 0.2, "d": 1.9}, 2) is None
    # 3 vs 1 -> 2 vs 2: 1 / 2 = 0.5 < 0.75 -> move
    assert should_move("a", {"a": 0, "b": 0, "c": 0, "d": 1}, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, 2) == 1
    # gain too small: old min 1.8, new min(2.0, 2.8) = 2.0: 0.9 >= 0.75 -> stay
    assert should_move("c", {"a": 0, "b": 0, "c": 0, "d": 1}, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.8}, 2) is None


def test_empty_stage_is_filled_and_no_stage_is_left_empty():
    assignment = {"a": 0, "b": 0, "c": 1}
    throughput = dict.fromkeys(assignment, 1.0)
    assert choose_stage(assignment, throughput, 3) == 2
    assert should_move("a", assignment, throughput, 3) == 2
    assert should_move("c", assignment, throughput, 3) is None  # its stage would be empty
    rebalance(assignment, throughput, 3, periods=3)
    assert sorted(assignment.values()) == [0, 1, 2]


def test_rebalance_delay_has_jitter_within_bounds():
    rng = random.Random(0)
    delays = [rebalance_delay_s(90.0, rng) for _ in range(200)]
    assert all(60.0 <= d <= 120.0 for d in delays)
    assert max(delays) - min(delays) > 30.0


def test_config_validation_explains_itself():
    assert SwarmConfig().codec == "fp16"
    with pytest.raises(ValueError, match="codec"):
        SwarmConfig(codec="zip")
    with pytest.raises(ValueError, match="pending_timeout_s"):
        SwarmConfig(call_timeout_s=60.0, pending_timeout_s=30.0)
    with pytest.raises(ValueError, match="stages"):
        SwarmConfig(stages=0)


def test_servers_reading_the_same_view_elect_one_mover():
    # before the election every stage-0 server of 3 + 1 moved at once and the swarm overshot to 1 + 3
    assignment = {"a": 0, "b": 0, "c": 0, "d": 1}
    throughput = {"a": 0.5, "b": 1.0, "c": 1.0, "d": 0.2}
    targets = {server: should_move(server, assignment, throughput, 2) for server in "abc"}
    # moving a leaves a bottleneck of min(2.0, 0.7) = 0.7, moving b or c min(1.5, 1.2) = 1.2: b (lower than c) moves
    assert targets == {"a": None, "b": 1, "c": None}, targets
    # with equal throughputs the lowest PeerID moves; once it has, nobody else does
    equal = dict.fromkeys(assignment, 1.0)
    assert [s for s in "abc" if should_move(s, assignment, equal, 2) is not None] == ["a"]
    after = {**assignment, "a": 1}
    assert all(should_move(s, after, equal, 2) is None for s in after)


def test_move_claims_are_validated_and_any_other_standing_claim_holds_a_move_back():
    from protocols.swarm import MoveClaim, move_claim_stands

    claim = MoveClaim(0, 1, 1000.5)
    assert MoveClaim.parse(claim.to_dict(), 2) == claim
    for bad in ({"source": 0, "target": 2, "claimed_at": 1.0}, {"source": True, "target": 1, "claimed_at": 1.0},
                {"source": 0, "target": 1, "claimed_at": float("nan")}, {"source": 0, "target": 1},
                {"source": 0, "target": 1, "claimed_at": 1.0, "withdrawn": "no"}, [0, 1], None):
        assert MoveClaim.parse(bad, 2) is None, bad
    later, earlier = MoveClaim(0, 1, 1001.0), MoveClaim(1, 0, 999.0)
    assert move_claim_stands("a", {"a": claim})
    assert move_claim_stands("a", {"a": claim, "b": MoveClaim(0, 1, 999.0, withdrawn=True)})
    # not "the earliest wins": the earlier claimant may not have seen this claim and be moving already
    assert not move_claim_stands("a", {"a": claim, "b": later})
    assert not move_claim_stands("a", {"a": claim, "b": earlier})
