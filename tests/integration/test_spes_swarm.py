"""Real peers (hivemind DHT + p2pd, one process each) training the tiny MoE the SPES way on Shakespeare."""

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPES_RUN = """
model = "tiny-moe"
parallelism = "spes"
seq_len = 64
batch_size = 8
dataset = "shakespeare"
max_outer_rounds = 3
eval_batches = 4

[diloco]
warmup_steps = 5
inner_lr = 2e-3

[spes]
sync_steps = 10
merge_interval = 5
merge_decay_steps = 100

[averaging.matchmaking]
min_group_size = 1
matchmaking_timeout_s = 15
request_timeout_s = 3

[averaging.allreduce]
compression = "fp16"
sender_timeout_s = 10
reducer_timeout_s = 20

[averaging.state_transfer]
download_timeout_s = 20
"""


def _experts(peer):
    """The experts ``peer`` trains, from its latest ``experts_claimed`` event."""
    claims = peer.of("experts_claimed")
    return set(claims[-1]["experts"]) if claims else set()


def test_four_spes_peers_learn_and_a_killed_peers_experts_are_reclaimed(swarm, tmp_path):
    """4 peers train together; after round 1 one is killed (SIGKILL, no goodbye): the 3 survivors re-claim its
    experts from their synced copies, finish the run with one model and keep learning."""
    import signal

    from peerd.testing.localswarm import signal_group

    config = tmp_path / "spes.toml"
    config.write_text(SPES_RUN)
    swarm.start_bootstrap()
    peers = [swarm.start_peer(f"p{i}", "spes", config) for i in range(4)]
    swarm.wait_for(lambda: all(p.digests().get(1) for p in peers), 180, "round 1 on all four peers")
    # round 1 was one group of four: the same shared parameters everywhere, each expert with its holders
    assert len({p.digests()[1] for p in peers}) == 1, swarm.tails()
    assert all(p.of("outer_round")[0]["group_size"] == 4 for p in peers), swarm.tails()
    victim = peers[3]
    victim_experts = _experts(victim)
    signal_group(victim.proc.pid, signal.SIGKILL)
    survivors = peers[:3]
    for peer in survivors:
        assert swarm.wait_exit(peer, 240) == 0, swarm.tails()
    assert victim_experts, swarm.tails()
    for peer in survivors:
        rounds = peer.of("outer_round")
        assert [e["outer_round"] for e in rounds] == [1, 2, 3], swarm.tails()
        assert all(e["method"] == "spes" and e["bytes_sent"] > 0 for e in rounds)
        assert rounds[-1]["group_size"] == 3
        start = peer.of("eval")[0]["eval_nats_per_byte"]
        assert rounds[-1]["eval_nats_per_byte"] < rounds[0]["eval_nats_per_byte"] < start, (start, rounds)
    owned = [_experts(p) for p in survivors]
    assert victim_experts <= set().union(*owned) and set().union(*owned) == set(range(8))
    for r in (2, 3):  # digest of the shared parameters after the sync of round r
        digests = {p.digests().get(r) for p in survivors}
        assert len(digests) == 1 and None not in digests, f"round {r}: {digests}"
    # the last round's eval is the same model on every survivor
    assert len({p.of("outer_round")[-1]["eval_nats_per_byte"] for p in survivors}) == 1
