"""Real peers (hivemind DHT + p2pd, one process each) training the tiny model with DiLoCo on Shakespeare."""

import signal
import time

import pytest

from peerd.identity.key import load_or_create_identity
from peerd.testing.localswarm import TINY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _config(tmp_path, name, **changes):
    """The tiny test run config with some top-level keys changed."""
    text = TINY.read_text()
    for key, value in changes.items():
        lines = [f"{key} = {value}" if line.split("=")[0].strip() == key else line for line in text.splitlines()]
        text = "\n".join(lines) + "\n"
    path = tmp_path / name
    path.write_text(text)
    return path


def _assert_bit_identical(peers, rounds):
    """Every peer logged the same theta_outer digest after each of ``rounds``."""
    for round_ in rounds:
        digests = {p.digests().get(round_) for p in peers}
        assert len(digests) == 1 and None not in digests, f"round {round_}: {digests}"


def test_three_peers_hold_bit_identical_theta_outer_and_learn(swarm, tmp_path):
    """A mixed swarm: d0 and d1 use the direct data plane (their streams to each other go over direct TCP), p2 only
    p2pd (the direct peers fall back to p2pd for it). Every round is bit-identical on all three."""
    # all three in every group: the peer that starts first (the run's creator) waits at its first rendezvous for the
    # two others instead of sealing it alone when they start late (seen beside a CPU hog: the creator's round 1 was
    # a group of 1, the others downloaded its state and did round 2 only)
    config = tmp_path / "trio.toml"
    config.write_text(TINY.read_text().replace("min_group_size = 1", "min_group_size = 3")
                      .replace("matchmaking_timeout_s = 15", "matchmaking_timeout_s = 60"))
    swarm.start_bootstrap()
    peers = [swarm.start_peer(f"d{i}", "trio", config, env={"PEERD_DATA_PLANE": "direct"}) for i in range(2)]
    peers.append(swarm.start_peer("p2", "trio", config, env={"PEERD_DATA_PLANE": "p2p"}))
    for peer in peers:
        assert swarm.wait_exit(peer, 180) == 0, swarm.tails()
    _assert_bit_identical(peers, rounds=(1, 2))
    p2_id = load_or_create_identity(swarm.workdir / "p2.key")
    for direct in peers[:2]:
        assert len(direct.of("dataplane_listening")) == 1 and direct.of("direct_refused") == []
        # only the p2pd-only peer is reached through p2pd: d0 <-> d1 went direct
        assert [e["peer"] for e in direct.of("direct_fallback")] == [p2_id], direct.of("direct_fallback")
    assert peers[2].of("dataplane_listening") == []
    for peer in peers:
        rounds = peer.of("outer_round")
        assert [e["outer_round"] for e in rounds] == [1, 2]
        assert all(e["group_size"] == 3 for e in rounds), rounds
        assert all(e["bytes_sent"] > 0 for e in rounds)
        start = peer.of("eval")[0]["eval_nats_per_byte"]
        assert rounds[-1]["eval_nats_per_byte"] < start, (start, rounds[-1])


@pytest.mark.long
@pytest.mark.timeout(600)  # ~130 s in the suite's lane; ~400 s beside the churn scenario (12 trainers on 2 cores)
def test_late_joiner_downloads_state_and_averages_with_the_swarm(swarm, tmp_path):
    # rounds of ~6 s (~11 s on a loaded 2-core machine, ~90 s beside the churn scenario) and 4 of them, so that the
    # joiner (15-35 s from process start to adopted state under load) arrives while at least one round is still to
    # come; which round's state it downloads depends on the machine's speed, so every check below is relative to it
    rounds = 4
    config = _config(tmp_path, "run.toml", max_outer_rounds=rounds, inner_steps=60)
    swarm.start_bootstrap()
    first = [swarm.start_peer(f"p{i}", "late", config) for i in range(3)]
    swarm.wait_for(lambda: all(p.digests().get(1) for p in first), 120, "round 1 on the first three peers")
    started = time.time()
    joiner = swarm.start_peer("joiner", "late", None)  # no --run-config: reads the published one
    for peer in first + [joiner]:
        assert swarm.wait_exit(peer, 480) == 0, swarm.tails()
    downloads = joiner.of("state_download")
    assert downloads, swarm.tails()
    adopted = downloads[0]["outer_round"]
    print(f"FIGURE A10: joiner started after round 1; downloaded the round {adopted} state in "
          f"{downloads[0]['seconds']:.2f} s, {downloads[0]['time'] - started:.1f} s after its process started; "
          f"digests of rounds {adopted}..{rounds} on all 4 peers: "
          f"{[sorted({str(p.digests().get(r))[:12] for p in first + [joiner]}) for r in range(adopted, rounds + 1)]}; "
          f"joiner's last group {joiner.of('outer_round')[-1]['group_size'] if joiner.of('outer_round') else None}")
    assert 1 <= adopted < rounds, f"the joiner adopted round {adopted}: no round left to average in"
    # the adopted state and every later round are bit-identical on all four peers
    _assert_bit_identical(first + [joiner], rounds=range(adopted, rounds + 1))
    # after adopting the state the joiner trains and averages as a full member
    assert joiner.of("outer_round") and joiner.of("outer_round")[-1]["group_size"] == 4, swarm.tails()
    assert joiner.of("outer_round")[-1]["outer_round"] == rounds


def test_sigterm_checkpoints_and_restart_resumes(swarm, tmp_path):
    config = _config(tmp_path, "solo.toml", max_outer_rounds=3)
    peer = swarm.start_peer("solo", "solo", config)
    swarm.wait_for(lambda: peer.digests().get(1) is not None, 120, "round 1")
    digest_1 = peer.digests()[1]
    peer.proc.send_signal(signal.SIGTERM)
    assert swarm.wait_exit(peer, 60) == 0
    assert peer.of("leave"), "no leave event after SIGTERM"
    # join says what the run needs on this machine before it trains (the whole batch on a CPU)
    assert "memory: tiny: predicted peak" in peer.log.read_text() and "micro-batch 8 x 64 tokens" in \
        peer.log.read_text()
    last_round = peer.of("leave")[-1]["outer_round"]
    again = swarm.start_peer("solo", "solo", config)
    assert swarm.wait_exit(again, 120) == 0, swarm.tails()
    resumed = again.of("resume")
    assert resumed and resumed[0]["outer_round"] == last_round
    if last_round == 1:
        assert resumed[0]["digest"] == digest_1
    assert again.digests().get(3), "did not reach round 3 after resuming"


@pytest.mark.parametrize("method", ["moshpit", "gossip"])
def test_diloco_with_moshpit_and_gossip_learns_and_peers_stay_close(swarm, tmp_path, method):
    from safetensors.torch import load_file

    config = tmp_path / f"{method}.toml"
    text = _config(tmp_path, "base.toml", max_outer_rounds=3).read_text()
    config.write_text(text.replace('[averaging]', f'[averaging]\nmethod = "{method}"\ngroup_size = 2'))
    swarm.start_bootstrap()
    n = 4 if method == "moshpit" else 3  # moshpit: a full 2 x 2 grid, groups of 2 along alternating dimensions
    peers = [swarm.start_peer(f"p{i}", method, config) for i in range(n)]
    for peer in peers:
        assert swarm.wait_exit(peer, 180) == 0, swarm.tails()
    for peer in peers:
        rounds = peer.of("outer_round")
        done = [e["outer_round"] for e in rounds]
        # a moshpit peer whose groupmates finished a round without it joins their next round instead (peers that
        # start seconds apart on a loaded machine can split into two pairs that way); it says so, and skips nothing else
        # and a peer that started late adopted a live peer's state past the rounds it missed (a state download)
        adopted = max((e["outer_round"] for e in peer.of("state_download")), default=0)
        skipped = sorted(r for r in set(range(1, 4)) - set(done) if r > adopted)
        assert done == sorted(set(done)) and done[-1] == 3, done
        assert not skipped or (method == "moshpit" and "our moshpit groupmates moved on" in peer.log.read_text()
                               and len(skipped) == 1), (done, swarm.tails())
        assert rounds[-1]["eval_nats_per_byte"] < peer.of("eval")[0]["eval_nats_per_byte"]
        # it really averaged with others. A moshpit peer that starts late on a loaded machine can miss its first
        # groups: each "next group of late peers" it joins waits out the matchmaking window alone, which makes it late
        # for the next round too (seen beside a CPU hog: alone in rounds 1 and 2, with the others in round 3)
        assert sum(e["group_size"] > 1 for e in rounds) >= (1 if method == "moshpit" else 2), rounds
    thetas = [load_file(str(tmp_path / f"ckpt-p{i}" / method / "state.safetensors"))["theta_outer"] for i in range(n)]
    from peerd.models import build_model
    from protocols.diloco import flatten_parameters

    start = flatten_parameters(build_model("tiny", 64, 0))
    mean = sum(thetas) / n
    # spread of the peers relative to how far training moved the model: 0 for the all-reduce, O(1) with no averaging
    spread = max(float((t - mean).norm()) for t in thetas) / float((mean - start).norm())
    print(f"{method}: max ||theta_i - mean|| / ||mean - theta_0|| after 3 rounds = {spread:.3f}")
    assert spread < 0.5


def test_three_peers_with_delayed_overlap_and_fp4_stay_bit_identical_and_learn(swarm, tmp_path):
    """``[diloco] overlap = "delayed"`` and fp4 pseudo-gradients: each round's all-reduce runs during the next round's
    inner steps; the last one is drained on exit. theta_outer stays bit-identical and the eval loss falls."""
    config = tmp_path / "overlap-fp4.toml"
    text = _config(tmp_path, "base.toml", max_outer_rounds=3).read_text()
    text = text.replace("[diloco]\n", '[diloco]\noverlap = "delayed"\n', 1)
    text = text.replace('[averaging.allreduce]        # protocols/allreduce/config.py AllReduceConfig\ncompression = "fp16"',
                        '[averaging.allreduce]\ncompression = "fp4"', 1)
    assert 'overlap = "delayed"' in text and 'compression = "fp4"' in text
    config.write_text(text)
    swarm.start_bootstrap()
    peers = [swarm.start_peer(f"o{i}", "overlap", config) for i in range(3)]
    for peer in peers:
        assert swarm.wait_exit(peer, 180) == 0, swarm.tails()
    _assert_bit_identical(peers, rounds=(1, 2, 3))
    for peer in peers:
        rounds = peer.of("outer_round")
        got = [e["outer_round"] for e in rounds]
        assert got[-1] == 3 and got == sorted(set(got)), got
        if got[0] != 1:  # started late (a loaded machine): it must have caught up through the swarm's state
            assert peer.of("state_download"), f"{peer.name} skipped rounds {got} without downloading the state"
        assert any(e["group_size"] == 3 for e in rounds), rounds
        assert rounds[-1]["eval_nats_per_byte"] < peer.of("eval")[0]["eval_nats_per_byte"]
    assert sum(len(p.of("outer_round")) for p in peers) >= 8  # at most one round missed in the whole swarm
