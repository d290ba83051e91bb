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


def test_three_spes_peers_end_each_round_with_the_same_shared_parameters_and_learn(swarm, tmp_path):
    config = tmp_path / "spes.toml"
    config.write_text(SPES_RUN)
    swarm.start_bootstrap()
    peers = [swarm.start_peer(f"p{i}", "spes", config) for i in range(3)]
    for peer in peers:
        assert swarm.wait_exit(peer, 240) == 0, swarm.tails()
    for peer in peers:
        rounds = peer.of("outer_round")
        assert [e["outer_round"] for e in rounds] == [1, 2, 3], swarm.tails()
        assert all(e["method"] == "spes" and e["bytes_sent"] > 0 for e in rounds)
        start = peer.of("eval")[0]["eval_nats_per_byte"]
        assert rounds[-1]["eval_nats_per_byte"] < start, (start, rounds[-1])
    for r in (1, 2, 3):  # digest of the shared parameters after the sync of round r
        digests = {p.digests().get(r) for p in peers}
        assert len(digests) == 1 and None not in digests, f"round {r}: {digests}"
    # every round's last eval is the same model on every peer
    assert len({p.of("outer_round")[-1]["eval_nats_per_byte"] for p in peers}) == 1


def _experts(peer):
    """The experts ``peer`` trains, from its latest ``experts_claimed`` event."""
    claims = peer.of("experts_claimed")
    return set(claims[-1]["experts"]) if claims else set()


def test_a_killed_peers_experts_are_reclaimed_and_training_continues(swarm, tmp_path):
    import signal

    from peerd.testing.localswarm import signal_group

    config = tmp_path / "spes.toml"
    config.write_text(SPES_RUN.replace("max_outer_rounds = 3", "max_outer_rounds = 5"))
    swarm.start_bootstrap()
    peers = [swarm.start_peer(f"p{i}", "spes-kill", config) for i in range(3)]
    swarm.wait_for(lambda: all(p.digests().get(1) for p in peers), 180, "round 1 on all three peers")
    victim = peers[2]
    victim_experts = _experts(victim)
    signal_group(victim.proc.pid, signal.SIGKILL)
    survivors = peers[:2]
    for peer in survivors:
        assert swarm.wait_exit(peer, 240) == 0, swarm.tails()
    assert victim_experts, swarm.tails()
    for peer in survivors:
        rounds = peer.of("outer_round")
        assert [e["outer_round"] for e in rounds] == [1, 2, 3, 4, 5], swarm.tails()
        assert rounds[-1]["group_size"] == 2
        assert rounds[-1]["eval_nats_per_byte"] < peer.of("eval")[0]["eval_nats_per_byte"]
    assert victim_experts <= _experts(survivors[0]) | _experts(survivors[1])
    assert _experts(survivors[0]) | _experts(survivors[1]) == set(range(8))
    assert survivors[0].digests()[5] == survivors[1].digests()[5]
