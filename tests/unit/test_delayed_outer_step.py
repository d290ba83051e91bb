"""The delayed (one-round-late) outer step of overlapped DiLoCo rounds (protocols.diloco.DelayedOuterStep)."""

import pytest
import torch

from protocols.diloco import OVERLAPS, DelayedOuterStep, DiLoCoHyperparams, OuterState

pytestmark = pytest.mark.timeout(30)

HP = DiLoCoHyperparams(outer_lr=0.5, outer_momentum=0.5, outer_nesterov=True)


def test_three_rounds_equal_the_hand_computed_reference():
    theta0 = torch.tensor([1.0, -2.0])
    step = DelayedOuterStep(OuterState.initial(theta0))
    a0, a1 = torch.tensor([1.0, 0.5]), torch.tensor([0.5, -1.0])  # the all-reduced averages of rounds 0 and 1
    local = [torch.tensor([0.0, -2.5]), torch.tensor([0.5, -1.5]), torch.tensor([0.0, -2.0])]

    # round 0: nothing in flight yet: theta_outer stays, round 1 starts from theta0
    step, d0 = step.boundary(local[0], None, HP)
    assert torch.equal(d0, torch.tensor([1.0, 0.5]))
    assert torch.equal(step.state.theta, theta0) and step.state.outer_round == 0

    # round 1: a0 lands; by hand: buf = a0 = [1, .5]; step = a0 + .5 buf = [1.5, .75]; theta = theta0 - .5 step
    step, d1 = step.boundary(local[1], a0, HP)
    assert torch.equal(d1, theta0 - local[1])  # round 1 started from theta0, not from the updated theta
    assert torch.equal(step.state.theta, torch.tensor([0.25, -2.375]))
    assert torch.equal(step.state.momentum, torch.tensor([1.0, 0.5]))

    # round 2: a1 lands; buf = .5 [1, .5] + a1 = [1, -.75]; step = a1 + .5 buf = [1, -1.375]
    step, d2 = step.boundary(local[2], a1, HP)
    assert torch.equal(d2, torch.tensor([0.25, -2.375]) - local[2])
    assert torch.equal(step.state.theta, torch.tensor([-0.25, -1.6875]))
    assert torch.equal(step.state.momentum, torch.tensor([1.0, -0.75]))
    assert step.state.outer_round == 2

    # the same averages applied without overlap give the same theta_outer, one round earlier
    none = OuterState.initial(theta0).apply(a0, HP).apply(a1, HP)
    assert none.digest() == step.state.digest()


def test_a_failed_background_round_leaves_theta_outer_unchanged():
    state = OuterState.initial(torch.tensor([1.0, 2.0, 3.0])).apply(torch.tensor([0.5, 0.5, 0.5]), HP)
    step = DelayedOuterStep(state)
    before = state.digest()
    after, delta = step.boundary(torch.tensor([0.0, 1.0, 2.0]), None, HP)
    assert after.state.digest() == before and after.state.outer_round == state.outer_round
    assert torch.equal(delta, state.theta - torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError):  # a bad average is refused and nothing changes
        step.boundary(torch.zeros(3), torch.tensor([float("nan"), 0.0, 0.0]), HP)
    assert state.digest() == before


def test_peers_applying_the_same_averages_stay_bit_identical():
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(1000, generator=g)
    peers = [DelayedOuterStep(OuterState.initial(theta0)) for _ in range(3)]
    finished = None
    for _ in range(4):
        deltas = []
        for i, peer in enumerate(peers):
            local = peer.state.theta - torch.randn(1000, generator=g) * 0.01
            peers[i], d = peer.boundary(local, finished, HP)
            deltas.append(d)
        finished = sum(deltas) / 3
    assert len({p.state.digest() for p in peers}) == 1
    assert OVERLAPS == ("none", "delayed")
