"""Real peers on the py-libp2p transport: beside p2pd peers in one swarm, and alone where p2pd cannot run.

Network: every peer listens on 127.0.0.1 only; run inside a loopback-only namespace (``unshare -n``).
"""

import json
import os
import signal
import subprocess

import pytest

from peerd.identity.key import load_or_create_identity
from peerd.testing.localswarm import TINY, peerd_cmd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]  # 175-185 s each measured on a heavily loaded 2-core machine

#: Where the p2pd binary is "installed" when a test makes it unavailable.
NOWHERE = {"PEERD_P2PD_BINARY": "/nonexistent/p2pd"}


def _run_config(tmp_path, group, rounds=2):
    """The tiny run of ``rounds`` outer rounds, each matchmaking waiting for the whole ``group`` (so every round
    averages every peer)."""
    text = TINY.read_text().replace("min_group_size = 1", f"min_group_size = {group}")
    text = text.replace("max_outer_rounds = 2", f"max_outer_rounds = {rounds}")
    text = text.replace("matchmaking_timeout_s = 15", "matchmaking_timeout_s = 60")
    assert f"min_group_size = {group}" in text
    path = tmp_path / f"run-{group}.toml"
    path.write_text(text)
    return path


def _assert_trained_together(swarm, peers, group):
    for peer in peers:
        assert swarm.wait_exit(peer, 300) == 0, swarm.tails()
    for round_ in (1, 2):  # (a peer stopped by SIGTERM may have completed more)
        digests = {p.digests().get(round_) for p in peers}
        assert len(digests) == 1 and None not in digests, f"round {round_}: {digests}\n{swarm.tails()}"
    for peer in peers:
        rounds = peer.of("outer_round")
        assert [e["outer_round"] for e in rounds][:2] == [1, 2], swarm.tails()
        assert all(e["group_size"] == group for e in rounds[:2]), rounds


def test_mixed_swarm_of_p2pd_and_libp2p_peers_trains_bit_identically(swarm, tmp_path):
    """2 peers on p2pd + 2 on py-libp2p (bootstrap on p2pd): they find each other through the DHT and end both
    DiLoCo outer rounds with bit-identical theta_outer."""
    config = _run_config(tmp_path, 4)
    swarm.start_bootstrap(120.0)  # (a loaded machine takes long to start a process)
    peers = [swarm.start_peer(f"go{i}", "mixed", config, "--transport", "p2pd") for i in range(2)]
    peers += [swarm.start_peer(f"py{i}", "mixed", config, "--transport", "libp2p") for i in range(2)]
    _assert_trained_together(swarm, peers, 4)
    assert all(len(p.of("outer_round")) == 2 for p in peers), swarm.tails()


def test_pure_libp2p_swarm_without_p2pd_trains_and_is_listed(swarm, tmp_path):
    """No usable p2pd binary: ``transport = auto`` picks py-libp2p (and says why); 3 peers and the bootstrap node
    train together, and ``peerd status`` (on py-libp2p too) lists all three by the PeerIDs of their identity files.
    The run is open-ended (the peers are stopped with SIGTERM), so that they are still there when asked."""
    config = _run_config(tmp_path, 3, rounds=100)
    swarm.start_bootstrap(120.0, "--transport", "auto", env=NOWHERE)
    peers = [swarm.start_peer(f"py{i}", "pure", config, "--transport", "auto", env=NOWHERE) for i in range(3)]
    swarm.wait_for(lambda: all(p.of("inner") for p in peers), 150, "all three peers training")
    status = subprocess.run(peerd_cmd("status", "--run-id", "pure", "--initial-peers", swarm.bootstrap_maddr,
                                      "--json", "--transport", "auto"),
                            capture_output=True, text=True, timeout=150, env={**os.environ, **NOWHERE})
    swarm.wait_for(lambda: all(p.digests().get(2) for p in peers), 150, "round 2 on all three peers")
    for peer in peers:
        peer.proc.send_signal(signal.SIGTERM)
    _assert_trained_together(swarm, peers, 3)
    assert status.returncode == 0, status.stderr
    listed = json.loads(status.stdout)["peers"]
    ids = {load_or_create_identity(swarm.workdir / f"py{i}.key") for i in range(3)}
    assert ids <= set(listed), (ids, listed)
    for peer in peers:
        chosen = [e for e in peer.poll_events() if "transport libp2p" in str(e.get("message"))]
        assert chosen and "/nonexistent/p2pd" in chosen[0]["message"], peer.events[:5]
