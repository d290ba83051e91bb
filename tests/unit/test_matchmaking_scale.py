"""Matchmaking with many peers arriving spread out (in-process, on the simulator's virtual clock)."""

import asyncio

import pytest

from peerd.testing.sim import run_virtual
from peerd.transport.inprocess import Hub
from protocols.matchmaking import MatchmakingConfig, MatchmakingFailed
from tests.unit.conftest import start_averaging_peers

WINDOW = MatchmakingConfig(matchmaking_timeout_s=1.0, request_timeout_s=0.5, poll_interval_s=0.05)


async def _form(peers, delays, key="moshpit.r0", expected=None, on_late="fail"):
    async def one(peer, delay):
        await asyncio.sleep(delay)
        try:
            group = await peer.matchmaker.form_group(key, {}, expected_size=expected, on_late=on_late)
            return group.key, group.members
        except MatchmakingFailed as e:
            return "failed", str(e)

    return await asyncio.gather(*(one(p, d) for p, d in zip(peers, delays)))


@pytest.mark.timeout(60)
def test_32_peers_arriving_over_twice_the_window_form_one_group():
    async def main():
        peers = await start_averaging_peers(Hub(), 32, "run", WINDOW)
        # arrivals 0.06 s apart: 1.9 s from first to last, almost twice the 1 s window (previously the group was
        # sealed 1 s after the first arrival and the later half failed with "already sealed")
        return await _form(peers, [0.06 * i for i in range(32)], expected=32)

    outcomes = run_virtual(main())
    assert {len(members) for _, members in outcomes} == {32}
    assert len({members for _, members in outcomes}) == 1


@pytest.mark.timeout(60)
def test_without_an_expected_size_the_group_seals_one_window_after_the_last_arrival():
    async def main():
        loop = asyncio.get_running_loop()
        peers = await start_averaging_peers(Hub(), 3, "run", WINDOW)
        out = await _form(peers, [0.0, 0.5, 0.9])
        return out, loop.time()

    out, took = run_virtual(main())
    assert [len(m) for _, m in out] == [3, 3, 3]
    assert took == pytest.approx(0.9 + 1.0, abs=0.2)


@pytest.mark.timeout(60)
def test_a_growing_group_seals_at_the_first_members_max_wait():
    async def main():
        loop = asyncio.get_running_loop()
        peers = await start_averaging_peers(Hub(), 4, "run", MatchmakingConfig(1.0, 0.5, 0.05, max_wait_s=1.5))
        out = await _form(peers, [0.0, 0.6, 1.2, 1.8], expected=4)  # still growing when the first one's cap is up
        return out, loop.time()

    out, took = run_virtual(main())
    assert [len(m) for _, m in out[:3]] == [3, 3, 3]
    assert out[3][0] == "failed" and "already sealed" in out[3][1]
    assert took < 2.5


@pytest.mark.timeout(60)
def test_a_late_peer_forms_the_next_group_instead_of_failing():
    async def main():
        peers = await start_averaging_peers(Hub(), 5, "run", WINDOW)
        # 3 peers seal at once (expected 3); two come after the seal
        first = await _form(peers[:3], [0, 0, 0], expected=3)
        failing = await _form(peers[3:4], [0], expected=3)
        late = await _form(peers[3:], [0, 0.1], expected=3, on_late="next")
        return first, failing, late

    first, failing, late = run_virtual(main())
    assert {len(m) for _, m in first} == {3}
    assert failing[0][0] == "failed" and "already sealed" in failing[0][1]
    assert [k for k, _ in late] == ["moshpit.r0.late1"] * 2
    assert all(len(m) == 2 for _, m in late)
