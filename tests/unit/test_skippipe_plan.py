"""SkipPipe's pure decisions: micro-batch paths (skip fraction, convergence share, slow stages first) and the
collision-aware schedule (no double booking, slow servers get less, rescheduling after a server leaves)."""

import random

import pytest

from protocols.skippipe import (
    NoPath, best_assignment_schedule, default_min_share, generate_paths, schedule, skip_counts, skips_per_path,
)

pytestmark = pytest.mark.timeout(30)


def check_paths(paths, num_stages, k, min_share, available=None):
    middle = [j for j in range(1, num_stages - 1) if available is None or j in available]
    for p in paths:
        assert p[0] == 0 and p[-1] == num_stages - 1
        assert all(a < b for a, b in zip(p, p[1:])), p
        if available is None:
            assert (num_stages - len(p)) / num_stages <= k + 1e-9, p
        else:
            assert set(p) <= set(available)
    for j in middle:
        assert sum(j in p for p in paths) >= min_share * len(paths) - 1e-9, (j, paths)


@pytest.mark.parametrize("num_stages,k", [(4, 0.25), (6, 1 / 3), (6, 0.5), (8, 0.25), (8, 0.5), (3, 0.5), (2, 0.4),
                                          (4, 0.0), (12, 0.9)])
def test_paths_visit_ends_in_order_skip_at_most_k_and_train_every_stage(num_stages, k):
    share = default_min_share(num_stages, k)
    paths = generate_paths(num_stages, k, 97, seed=5)
    assert len(paths) == 97
    check_paths(paths, num_stages, k, share)
    s = skips_per_path(num_stages, k)
    assert all(len(p) == num_stages - s for p in paths)
    # slow middle stages are skipped first, down to the convergence share and not below
    slow = {j: 1.0 for j in range(1, num_stages - 1)}
    slow[1] = 5.0
    paths = generate_paths(num_stages, k, 97, seconds=slow, seed=5)
    check_paths(paths, num_stages, k, share)
    if s and num_stages > 3:
        visits = {j: sum(j in p for p in paths) for j in slow}
        assert visits[1] == min(visits.values()) < max(visits.values())


def test_paths_are_deterministic_for_a_seed_and_spread_evenly():
    a = generate_paths(6, 1 / 3, 60, seed="peer-a")
    assert a == generate_paths(6, 1 / 3, 60, seed="peer-a")
    assert a != generate_paths(6, 1 / 3, 60, seed="peer-b")
    visits = [sum(j in p for p in a) for j in range(1, 5)]
    assert visits == [30, 30, 30, 30]  # equal stages: skips dealt evenly
    # skips interleave over the window instead of bunching (each window of 4 micro-batches skips every stage twice)
    for w in range(0, 60, 4):
        assert [sum(j not in p for p in a[w:w + 4]) for j in range(1, 5)] == [2, 2, 2, 2]


def test_the_convergence_share_is_a_hard_floor_and_infeasible_shares_are_refused():
    paths = generate_paths(6, 0.5, 40, seconds={1: 100.0, 2: 1.0, 3: 1.0, 4: 1.0}, min_share=0.2, seed=1)
    check_paths(paths, 6, 0.5, 0.2)
    assert sum(1 in p for p in paths) == 8  # skipped as often as the floor allows
    with pytest.raises(ValueError):
        generate_paths(6, 0.5, 40, min_share=0.3)  # 3 of 4 skipped per path leaves each stage 25% at most
    with pytest.raises(ValueError):
        generate_paths(4, 1.0, 4)


def test_stages_without_a_server_are_skipped_and_the_ends_are_required():
    paths = generate_paths(6, 1 / 3, 30, available=[0, 1, 3, 4, 5], seed=0)
    check_paths(paths, 6, 1 / 3, default_min_share(6, 1 / 3), available=[0, 1, 3, 4, 5])
    # stage 2 used one of the two skips of the k budget: one more skip each
    assert all(len(p) == 4 for p in paths)
    with pytest.raises(NoPath):
        generate_paths(4, 0.25, 3, available=[1, 2, 3])
    with pytest.raises(NoPath):
        generate_paths(4, 0.25, 3, available=[0, 1, 2])


def test_skip_counts_water_fill():
    assert skip_counts(10, [1, 1], 8) == [5, 5]
    assert skip_counts(10, [3, 1], 6) == [6, 4]
    assert sum(skip_counts(7, [1, 2, 4], 4)) == 7 and max(skip_counts(7, [1, 2, 4], 4)) <= 4
    with pytest.raises(ValueError):
        skip_counts(9, [1, 1], 4)


def no_double_booking(sched):
    by_server = {}
    for b in sched.bookings:
        by_server.setdefault(b.server, []).append((b.start, b.end))
    for intervals in by_server.values():
        intervals.sort()
        for (_, e1), (s2, _) in zip(intervals, intervals[1:]):
            assert s2 >= e1 - 1e-9, intervals


def check_schedule(sched, paths, servers):
    no_double_booking(sched)
    for mb, p in enumerate(paths):
        mine = [b for b in sched.bookings if b.mb == mb]
        assert sorted({b.stage for b in mine}) == list(p)
        for b in mine:
            assert b.server in servers[b.stage]
        fwd = {b.stage: b for b in mine if b.phase != "backward"}
        back = {b.stage: b for b in mine if b.phase == "backward"}
        assert set(back) == set(p[:-1]) and fwd[p[-1]].phase == "loss"
        for a, c in zip(p, p[1:]):  # causality: forward in order, backward in reverse, on the forward's server
            assert fwd[c].start >= fwd[a].end - 1e-9
            assert back[a].server == fwd[a].server
            assert back[a].start >= (back[c].end if c in back else fwd[c].end) - 1e-9


def test_schedule_never_double_books_and_slow_servers_get_fewer_micro_batches():
    servers = {0: {"a0": 1.0, "b0": 1.0}, 1: {"a1": 1.0, "slow1": 3.0}, 2: {"a2": 1.0, "b2": 1.0},
               3: {"a3": 0.5, "b3": 0.5}}
    paths = generate_paths(4, 0.25, 24, seconds={1: 0.75, 2: 0.5}, seed=0)
    sched = schedule(paths, servers)
    check_schedule(sched, paths, servers)
    counts = sched.visits_by_server()
    assert counts.get("slow1", 0) < counts["a1"]
    assert counts["a0"] + counts["b0"] == 24
    # a server that leaves: the same call without it keeps every constraint
    left = {**servers, 1: {"slow1": 3.0}}
    paths2 = generate_paths(4, 0.25, 24, seconds={1: 3.0, 2: 0.5}, seed=0)
    sched2 = schedule(paths2, left)
    check_schedule(sched2, paths2, left)
    assert "a1" not in sched2.visits_by_server()
    # a whole middle stage that leaves: its visits are skipped, the rest scheduled
    gone = {k: v for k, v in servers.items() if k != 2}
    paths3 = generate_paths(4, 0.25, 24, available=gone, seed=0)
    sched3 = schedule(paths3, gone)
    check_schedule(sched3, paths3, gone)
    with pytest.raises(NoPath):
        schedule([(0, 1, 2, 3)], gone)


def test_greedy_schedule_is_close_to_the_best_assignment_on_small_instances():
    rng = random.Random(0)
    ratios = []
    for _ in range(6):
        servers = {k: {f"s{k}{i}": rng.choice([1.0, 1.0, 2.0, 3.0]) for i in range(rng.choice([1, 2]))}
                   for k in range(4)}
        paths = generate_paths(4, 0.25, 3, seed=rng.random())
        greedy, best = schedule(paths, servers), best_assignment_schedule(paths, servers)
        check_schedule(best, paths, servers)
        assert best.makespan <= greedy.makespan + 1e-9
        ratios.append(greedy.makespan / best.makespan)
    assert max(ratios) <= 1.35 and sum(ratios) / len(ratios) <= 1.1, ratios


def test_the_live_planner_follows_the_wiring():
    """Measured throughputs steer paths and servers; a banned server is planned around at once."""
    from protocols.skippipe import SkipPlanner
    from protocols.swarm import Wiring

    now = [0.0]
    wiring = Wiring(4, ban_s=10.0, clock=lambda: now[0])
    wiring.set_servers({0: ["a0"], 1: ["a1", "slow1"], 2: ["a2"], 3: ["a3"]})
    for stage, server, rate in ((0, "a0", 8.0), (1, "a1", 8.0), (1, "slow1", 8 / 3), (2, "a2", 8.0), (3, "a3", 8.0)):
        wiring.stages[stage].report(server, 8, 8 / rate)
    planner = SkipPlanner(4, 0.25, window=12, seed="t")
    plans = [planner.next(wiring) for _ in range(12)]
    assert planner.plans == 1
    assert all(p == (0, 1, 3) or p == (0, 2, 3) for p, _ in plans)
    by_server = [prefer[1] for p, prefer in plans if 1 in p]
    assert by_server.count("slow1") < by_server.count("a1")
    wiring.fail(2, "a2", "gone")  # stage 2's only server: every next path skips stage 2
    path, prefer = planner.next(wiring)
    assert planner.plans == 2 and path == (0, 1, 3) and set(prefer) == {0, 1, 3}
    wiring.fail(0, "a0", "gone")
    with pytest.raises(NoPath):
        planner.next(wiring)
