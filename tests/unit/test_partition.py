"""Bandwidth-proportional parts and chunk bounds of the butterfly all-reduce (protocols.partition), pure."""

import itertools

import pytest

from protocols.partition import (
    chunk_bounds, partition_sizes, proportional_fractions, proportional_sizes, valid_rate,
)

pytestmark = pytest.mark.timeout(30)


def _slowest(fractions, rates):
    """max_i (1 + (N - 2) x_i) / r_i: the model's time per byte of vector."""
    n = len(rates)
    return max((1 + (n - 2) * x) / r if r > 0 else (float("inf") if x > 0 or n > 1 else 0.0)
               for x, r in zip(fractions, rates))


@pytest.mark.parametrize("rates", [[1, 1, 1, 1], [100, 100, 20, 20], [5, 1, 1], [3, 2], [10, 0, 10, 10, 1],
                                   [1e9, 1, 1, 1, 1, 1, 1, 1], [7, 7, 7, 0]])
def test_sizes_sum_to_numel_within_bounds_and_zero_rate_reduces_nothing(rates):
    for numel in (0, 1, 7, 1000, 25_000_003):
        sizes = proportional_sizes(numel, rates)
        assert sum(sizes) == numel
        assert all(0 <= s <= numel for s in sizes)
        for s, r in zip(sizes, rates):
            if r == 0:
                assert s == 0
        fractions = proportional_fractions(rates)
        for s, f in zip(sizes, fractions):
            assert abs(s - f * numel) < 1.0 + 1e-9 * numel  # rounding moves each size by less than one value


def test_equal_rates_give_equal_parts():
    assert proportional_sizes(10, [3, 3, 3]) == partition_sizes(10, 3) == [4, 3, 3]
    assert proportional_fractions([2.0] * 8) == pytest.approx([1 / 8] * 8)


def test_two_of_four_slow_peers_reduce_nothing_and_the_bound_is_their_own_upload():
    # 2 peers at 100 Mbit/s, 2 at 20: the fast pair reduces everything; each slow peer still sends and receives
    # its vector once, which bounds the round at V / 20 (10 s for 25 MB fp32), where equal parts need 1.5 V / 20
    rates = [100.0, 100.0, 20.0, 20.0]
    fractions = proportional_fractions(rates)
    assert fractions == pytest.approx([0.5, 0.5, 0.0, 0.0])
    assert _slowest(fractions, rates) == pytest.approx(1 / 20)
    assert _slowest([0.25] * 4, rates) == pytest.approx(1.5 / 20)


@pytest.mark.parametrize("rates", [[100, 100, 20, 20], [5, 4, 3, 2, 1], [10, 9, 1], [1, 50, 50, 50, 2, 3]])
def test_the_split_is_optimal_against_a_grid(rates):
    best = _slowest(proportional_fractions(rates), rates)
    n = len(rates)
    steps = 20 if n <= 5 else 8
    for combo in itertools.product(range(steps + 1), repeat=n - 1):
        if sum(combo) > steps:
            continue
        x = [c / steps for c in combo] + [(steps - sum(combo)) / steps]
        assert _slowest(x, rates) >= best - 1e-12


def test_two_members_split_in_proportion():
    assert proportional_fractions([3, 1]) == pytest.approx([0.75, 0.25])
    assert proportional_sizes(8, [3, 1]) == [6, 2]


def test_bad_rates_are_refused():
    for rates in ([], [0, 0], [1, -1], [1, float("nan")], [float("inf"), 1]):
        with pytest.raises(ValueError):
            proportional_fractions(rates)
    assert valid_rate(1e6) == 1e6
    for bad in (True, "1", -1, float("nan"), float("inf"), 1e15, None):
        assert valid_rate(bad) is None


def test_chunk_bounds():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    assert chunk_bounds(0, 4) == [(0, 0)]
    with pytest.raises(ValueError):
        chunk_bounds(5, 0)


@pytest.mark.parametrize("rates", [[100, 100, 60, 30], [5, 4, 3, 2], [10, 9, 1], [100, 100, 20, 20], [7, 0, 7]])
def test_min_share_floors_members_within_the_spread_and_nobody_else(rates):
    from protocols.partition import FLOOR_SPREAD

    n = len(rates)
    floored = proportional_fractions(rates, min_share=0.25)
    optimal = proportional_fractions(rates)
    assert sum(floored) == pytest.approx(1.0)
    for f, o, r in zip(floored, optimal, rates):
        if r > 0 and r * FLOOR_SPREAD >= max(rates):
            assert f >= 0.25 / n - 1e-12
        else:  # a truly slow (or zero-rate) member keeps its optimal share: 0 here
            assert o == 0 and f == 0
    sizes = proportional_sizes(1000, rates, min_share=0.25)
    assert sum(sizes) == 1000 and all(s >= 0 for s in sizes)
    with pytest.raises(ValueError):
        proportional_fractions(rates, min_share=1.5)


@pytest.mark.parametrize("n", [3, 4, 8, 16, 64])
def test_the_validation_floor_costs_the_slowest_member_under_a_sixteenth(n):
    # two slow members 3.3x below the others: within FLOOR_SPREAD, so they keep the floor (a fast link's download is
    # measured below its line rate, paced by the senders' uplinks); the optimum gives them nothing
    from protocols.allreduce import MIN_SHARE

    rates = [9.8] * (n - 2) + [3.0, 3.0]
    optimal = proportional_fractions(rates)
    floored = proportional_fractions(rates, min_share=MIN_SHARE)
    assert optimal[-1] == 0 and floored[-1] == pytest.approx(MIN_SHARE / n)
    cost = _slowest(floored, rates) / _slowest(optimal, rates)
    assert cost == pytest.approx(1 + (n - 2) / n * MIN_SHARE)
    assert cost < 1 + 1 / 16
