"""Real peers on Streaming DiLoCo's path (2 fragments, each fragment's all-reduce overlapped with the next inner steps,
fp4 pseudo-gradients) under the faults the plain path survives (RELIABILITY rows A3, A10, A11): a peer SIGKILLed in
the middle of a fragment's transfer, the survivors finishing that round without it and agreeing, the dead peer
restarted from its checkpoint, downloading the state it fell behind on and averaging with the swarm again; and a peer
joining late (row A10) downloading the state and averaging with the swarm."""

import re
import signal

import pytest

from peerd.testing.faults import Faults
from tests.integration.test_diloco_swarm import _config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]  # ~110 s on an idle 2-core machine


def _streaming_config(tmp_path, **changes):
    """The tiny test run with 2 fragments, the delayed overlap and fp4 both ways."""
    text = _config(tmp_path, "base.toml", **changes).read_text()
    text = text.replace("[diloco]\n", '[diloco]\noverlap = "delayed"\nfragments = 2\n', 1)
    text = re.sub(r'(\[averaging\.allreduce\][^\n]*\n)compression = "fp16"',
                  r'\1compression = "fp4"\nresult_compression = "fp4"', text, count=1)
    assert "fragments = 2" in text and 'compression = "fp4"' in text
    path = tmp_path / "streaming.toml"
    path.write_text(text)
    return path


def _averages_with(swarm, joiner, peers, who: str) -> int:
    """Wait until ``joiner`` completed a round in a group with all of ``peers`` and they completed it too, then stop
    them all (SIGTERM, clean exits); returns that round."""
    swarm.wait_for(lambda: any(e["group_size"] == len(peers) + 1 for e in joiner.of("outer_round")), 150,
                   f"{who} averaging with the other {len(peers)}")
    last = joiner.of("outer_round")[-1]["outer_round"]
    swarm.wait_for(lambda: all(p.digests().get(last) for p in peers), 60, f"round {last} on the other peers")
    for peer in (*peers, joiner):
        peer.proc.send_signal(signal.SIGTERM)
    for peer in (*peers, joiner):
        assert swarm.wait_exit(peer, 60) == 0, swarm.tails()
    return last


def test_streaming_peer_killed_mid_transfer_restarts_downloads_and_rejoins(swarm, tmp_path):
    # min_group_size 3: the three survivors go on without the victim; max_outer_rounds far away: the test stops the
    # swarm (SIGTERM) once the restarted victim has averaged with it again, so no timing decides what is checked
    config = _streaming_config(tmp_path, max_outer_rounds=200, inner_steps=20, matchmaking_timeout_s=10,
                               min_group_size=3)
    swarm.start_bootstrap()
    peers = [swarm.start_peer(f"p{i}", "stream", config) for i in range(3)]
    victim = swarm.start_peer("victim", "stream", config,
                              env=Faults().kill(at_round=2, phase="allreduce", after_bytes=3000).environ())
    assert victim.proc.wait(180) == -9, swarm.tails()
    fired = [e for e in victim.of("fault") if e.get("action") == "kill"]
    assert len(fired) == 1 and fired[0]["bytes_sent"] == 3000
    # the victim comes back with its identity and checkpoint, no faults, once the survivors finished round 2 without
    # it: had it come back between their fragment rounds of round 2, the state it downloads (fragment 0 a round
    # further) would carry the round number of its own checkpoint, and before their round 2's first fragment round,
    # nothing to download at all
    swarm.wait_for(lambda: all(p.digests().get(2) for p in peers), 150, "round 2 on the three survivors")
    again = swarm.start_peer("victim", "stream", config)
    last = _averages_with(swarm, again, peers, "the restarted victim")
    resumed, downloads = again.of("resume"), again.of("state_download")
    print(f"FIGURE streaming A3/A10/A11: victim SIGKILLed after {fired[0]['bytes_sent']} bytes of a fragment part in "
          f"round 2; restarted: resumed at round {resumed[0]['outer_round'] if resumed else None}, downloaded round "
          f"{downloads[0]['outer_round'] if downloads else None}, averaged again in rounds "
          f"{[e['outer_round'] for e in again.of('outer_round') if e['group_size'] == 4]}; survivors' rounds "
          f"{[len(p.of('outer_round')) for p in peers]}, failed {[len(p.of('round_failed')) for p in peers]}")
    assert resumed, "the restarted victim did not resume from its checkpoint"
    # it came back behind the swarm and caught up by downloading the state, then averaged as a full member
    assert downloads and downloads[0]["outer_round"] > resumed[0]["outer_round"], swarm.tails()
    for peer in peers:  # every round, round 2 included, went on without the victim: no survivor is missing one
        assert all(r in peer.digests() for r in range(1, last + 1)), (peer.name, sorted(peer.digests()))
        assert any(e["outer_round"] == 2 for e in peer.of("outer_round")) or peer.of("state_download")
    # theta_outer bit-identical on every peer that finished a round, the victim's rounds after its return included
    # (rounds completed only: with fragments a state download is taken between two fragment rounds)
    for r in range(1, last + 1):
        digests = {e["digest"] for p in (*peers, again) for e in p.of("outer_round") if e["outer_round"] == r}
        assert len(digests) == 1, f"round {r}: {digests}"
    assert again.digests().get(last)


def test_streaming_late_joiner_downloads_the_state_and_averages_with_the_swarm(swarm, tmp_path):
    # RELIABILITY row A10 (late joiner) on the streaming path: a fresh peer joins two peers already past round 2,
    # adopts their state (every fragment's round with it) and takes part in their later fragment rounds with a
    # bit-identical theta_outer
    config = _streaming_config(tmp_path, max_outer_rounds=200, inner_steps=20, matchmaking_timeout_s=10,
                               min_group_size=2)
    swarm.start_bootstrap()
    peers = [swarm.start_peer(f"p{i}", "stream", config) for i in range(2)]
    swarm.wait_for(lambda: all(p.digests().get(2) for p in peers), 180, "round 2 on the first two peers")
    late = swarm.start_peer("late", "stream", config)
    last = _averages_with(swarm, late, peers, "the late peer")
    downloads = late.of("state_download")
    assert downloads and downloads[0]["outer_round"] >= 2, swarm.tails()
    assert not late.of("resume")  # a fresh peer: nothing to resume from
    # every round the late peer completed ends bit-identical to the others' (a download's own digest is not compared:
    # with fragments it is taken between two fragment rounds, some fragments a round further than its outer round)
    completed = {e["outer_round"]: e["digest"] for e in late.of("outer_round")}
    assert completed and min(completed) > downloads[0]["outer_round"]
    for r, digest in completed.items():
        assert {e["digest"] for p in peers for e in p.of("outer_round") if e["outer_round"] == r} == {digest}, r
