"""The overlapped outer step of DiLoCo rounds (protocols.diloco.DelayedOuterStep, Streaming DiLoCo sec. 2.3)."""

import pytest
import torch

from protocols.diloco import OVERLAPS, DelayedOuterStep, DiLoCoHyperparams, OuterState

pytestmark = pytest.mark.timeout(30)

HP = DiLoCoHyperparams(outer_lr=0.5, outer_momentum=0.5, outer_nesterov=True)


def test_three_rounds_equal_the_hand_computed_reference():
    theta0 = torch.tensor([1.0, -2.0])
    step = DelayedOuterStep(OuterState.initial(theta0))

    # round 0's inner steps end at local0; its pseudo-gradient goes to the background all-reduce
    d0 = step.boundary(torch.tensor([0.0, -2.5]))
    assert torch.equal(d0, torch.tensor([1.0, 0.5]))
    # the inner steps go on from local0 (no restart) to [0, -3] before round 0's average a0 lands.
    # by hand: buf = a0 = [1, .5]; step = a0 + .5 buf = [1.5, .75]; theta = theta0 - .5 step = [.25, -2.375]
    a0 = torch.tensor([1.0, 0.5])
    step = step.complete(a0, HP)
    assert torch.equal(step.state.theta, torch.tensor([0.25, -2.375])) and step.state.outer_round == 1
    assert torch.equal(step.state.momentum, torch.tensor([1.0, 0.5]))
    # merge with alpha = .5: .5 [0, -3] + .5 [.25, -2.375] = [.125, -2.6875]
    merged = step.merge(torch.tensor([0.0, -3.0]), HP)
    assert torch.equal(merged, torch.tensor([0.125, -2.6875]))

    # round 1 ends at [0.125, -2.1875]: its pseudo-gradient is taken against the new theta_outer
    d1 = step.boundary(torch.tensor([0.125, -2.1875]))
    assert torch.equal(d1, torch.tensor([0.125, -0.1875]))
    # a1 lands; buf = .5 [1, .5] + a1 = [1, -.75]; step = a1 + .5 buf = [1, -1.375]; theta = [-.25, -1.6875]
    a1 = torch.tensor([0.5, -1.0])
    step = step.complete(a1, HP)
    assert torch.equal(step.state.theta, torch.tensor([-0.25, -1.6875]))
    assert torch.equal(step.state.momentum, torch.tensor([1.0, -0.75]))

    # round 2's all-reduce fails: nothing moves, and round 3's pseudo-gradient covers rounds 2 and 3
    failed = step.complete(None, HP)
    assert failed is step and failed.state.outer_round == 2
    assert torch.equal(step.boundary(torch.tensor([-1.0, -2.0])), torch.tensor([0.75, 0.3125]))

    # the same averages applied without overlap give the same theta_outer
    none = OuterState.initial(theta0).apply(a0, HP).apply(a1, HP)
    assert none.digest() == step.state.digest()


def test_the_mixing_factor_spans_restart_and_keep():
    state = OuterState.initial(torch.tensor([1.0, 2.0]))
    local = torch.tensor([3.0, -2.0])
    restart = DelayedOuterStep(state).merge(local, DiLoCoHyperparams(overlap_mix=0.0))
    keep = DelayedOuterStep(state).merge(local, DiLoCoHyperparams(overlap_mix=1.0))
    assert torch.equal(restart, state.theta) and torch.equal(keep, local)
    assert DiLoCoHyperparams().overlap_mix == 0.5
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="overlap_mix"):
            DiLoCoHyperparams(overlap_mix=bad)
    with pytest.raises(ValueError, match="shape"):
        DelayedOuterStep(state).merge(torch.zeros(3), HP)


def test_a_bad_average_is_refused_and_changes_nothing():
    state = OuterState.initial(torch.tensor([1.0, 2.0, 3.0])).apply(torch.tensor([0.5, 0.5, 0.5]), HP)
    step = DelayedOuterStep(state)
    before = state.digest()
    with pytest.raises(ValueError):
        step.complete(torch.tensor([float("nan"), 0.0, 0.0]), HP)
    with pytest.raises(ValueError):
        step.boundary(torch.zeros(2))
    assert state.digest() == before and step.state is state


def test_peers_applying_the_same_averages_stay_bit_identical_whatever_their_merge_time():
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(1000, generator=g)
    peers = [DelayedOuterStep(OuterState.initial(theta0)) for _ in range(3)]
    locals_ = [theta0.clone() for _ in range(3)]
    for _ in range(4):
        deltas = []
        for i, peer in enumerate(peers):
            locals_[i] = locals_[i] - torch.randn(1000, generator=g) * 0.01
            deltas.append(peer.boundary(locals_[i]))
        average = sum(deltas) / 3
        for i, peer in enumerate(peers):  # peer i takes i more steps before the average lands
            for _ in range(i):
                locals_[i] = locals_[i] - torch.randn(1000, generator=g) * 0.01
            peers[i] = peer.complete(average, HP)
            locals_[i] = peers[i].merge(locals_[i], HP)
    assert len({p.state.digest() for p in peers}) == 1
    assert len({float(t.sum()) for t in locals_}) == 3  # theta_local is each peer's own
    assert OVERLAPS == ("none", "delayed")
