"""CenteredClip: equals the mean for agreeing inputs, resists a scaled sign flip; in the all-reduce (B1 control)."""

import asyncio

import pytest
import torch

from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceConfig, PartReducer
from protocols.matchmaking import MatchmakingConfig
from protocols.robust import centered_clip, weighted_coordinate_median

pytestmark = pytest.mark.timeout(60)


def test_weighted_median_per_coordinate():
    parts = torch.tensor([[1.0, 10.0], [2.0, 20.0], [100.0, -5.0]])
    assert torch.equal(weighted_coordinate_median(parts, torch.tensor([1.0, 1.0, 1.0])), torch.tensor([2.0, 10.0]))
    # a heavy peer pulls the median to its values
    assert torch.equal(weighted_coordinate_median(parts, torch.tensor([1.0, 1.0, 5.0])), torch.tensor([100.0, -5.0]))


def test_centered_clip_equals_the_weighted_mean_when_inputs_agree_within_tau():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(50, generator=g) * 0.01 for _ in range(5)]
    weights = [1.0, 2.0, 3.0, 1.0, 1.0]
    mean = sum(w * p for w, p in zip(weights, parts)) / sum(weights)
    torch.testing.assert_close(centered_clip(parts, weights, tau=10.0), mean, rtol=1e-5, atol=1e-7)


def test_centered_clip_resists_a_flipped_and_scaled_input():
    g = torch.Generator().manual_seed(1)
    center = torch.randn(1000, generator=g)
    honest = [center + 0.1 * torch.randn(1000, generator=g) for _ in range(3)]
    attack = -1000 * honest[0]
    honest_mean = sum(honest) / 3
    plain = (sum(honest) + attack) / 4
    robust = centered_clip(honest + [attack], [1.0] * 4, tau=1.0)
    assert float((plain - honest_mean).norm() / honest_mean.norm()) > 100  # the attack works on the mean
    assert float((robust - honest_mean).norm() / honest_mean.norm()) < 0.1
    with pytest.raises(ValueError):
        centered_clip([], [])
    with pytest.raises(ValueError):
        centered_clip(honest, [0.0, 0.0, 0.0])


def test_part_reducer_centered_clip_and_validation():
    r = PartReducer(4, "centered_clip", clip_tau=1.0)
    for i, v in enumerate([1.0, 1.1, 0.9, -1000.0]):
        r.add(f"p{i}", torch.full((4,), v), 1.0)
    assert float((r.mean() - 1.0).abs().max()) < 0.5
    with pytest.raises(ValueError):
        PartReducer(4, "median")


@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
def test_byzantine_sender_in_the_all_reduce(aggregation, averaging_peers):
    """B1 in miniature: one of 4 peers sends its part flipped and scaled x-1000. The mean is wrecked (control);
    CenteredClip keeps every part near the honest mean."""

    async def main():
        hub = Hub()
        peers = await averaging_peers(hub, [f"peer{i}" for i in range(4)], "b", MatchmakingConfig(2.0, 0.5, 0.05),
                                      AllReduceConfig("none", 1.0, 2.0, aggregation=aggregation, clip_tau=1.0))
        g = torch.Generator().manual_seed(2)
        center = torch.randn(400, generator=g)
        xs = [center + 0.05 * torch.randn(400, generator=g) for _ in range(4)]
        attacker = peers[3].allreduce
        fired = []

        def evil(part):
            fired.append(part.numel())
            return (-1000 * part).numpy().tobytes()

        attacker._encode_part = evil
        groups = await asyncio.gather(*[mm.form_group("r", {}, expected_size=4) for mm, _ in peers])
        results = await asyncio.gather(*[ar.run(g_, x, 1.0) for (_, ar), g_, x in zip(peers, groups, xs)])
        assert len(fired) == 3  # the attacker poisoned its slice of every other reducer's part
        honest_mean = sum(xs[:3]) / 3
        error = float((results[0].averaged - honest_mean).norm() / honest_mean.norm())
        if aggregation == "mean":
            assert error > 100
        else:
            # the attacker's own part is reduced by the attacker (honestly here); the three clipped parts stay close
            assert error < 0.2, error

    asyncio.run(main())
