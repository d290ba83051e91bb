"""RELIABILITY rows B4 (forged DHT records) and B5 (unauthorized peer) on real processes: a bootstrap node, two
listed workers of a run with an allowlist (its id names its creator), an honest peer that is not listed, and a
hostile one (tests/integration/hostile_member.py) that forges records and tries to get into rounds."""

import json
import signal
import sys
from pathlib import Path

import pytest

from peerd.identity.key import load_or_create_identity
from peerd.testing.localswarm import TINY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # 40-85 s on an idle 2-core machine; generous for a loaded one

HOSTILE = Path(__file__).with_name("hostile_member.py")


def test_forged_records_are_refused_and_an_unlisted_peer_is_never_admitted(swarm, tmp_path):
    a_id, b_id = (load_or_create_identity(tmp_path / f"{name}.key") for name in ("a", "b"))
    hostile_id = load_or_create_identity(tmp_path / "hostile.key")
    run_id = f"members@{a_id[:24]}"
    config = tmp_path / "run.toml"
    config.write_text(f'allowlist = ["{a_id}", "{b_id}"]\n'
                      + TINY.read_text().replace("max_outer_rounds = 2", "max_outer_rounds = 0")
                      .replace("eval_batches = 4", "eval_batches = 0"))
    maddr = swarm.start_bootstrap()
    a = swarm.start_peer("a", run_id, config)
    out = tmp_path / "hostile.json"
    hostile = swarm.start_process("hostile", [  # it waits for the listed peers' records before it strikes
        sys.executable, str(HOSTILE), "--initial-peers", maddr, "--run-id", run_id,
        "--identity", str(tmp_path / "hostile.key"), "--creator", a_id, "--listed", a_id, b_id,
        "--out", str(out), "--duration-s", "45", "--contested", "2",
    ])
    swarm.wait_for(lambda: bool(a.of("config_published")), 120, "the creator to publish the run config")
    b = swarm.start_peer("b", run_id, None)
    outsider = swarm.start_peer("outsider", run_id, None)  # honest, not listed

    assert swarm.wait_exit(outsider, 120) == 1, swarm.tails()
    assert "is not on the allowlist" in outsider.log.read_text()
    assert swarm.wait_exit(hostile, 150) == 0, swarm.tails()
    for peer in (a, b):
        peer.proc.send_signal(signal.SIGINT)
    for peer in (a, b):
        assert swarm.wait_exit(peer, 60) == 0, swarm.tails()

    summary = json.loads(out.read_text())
    print("B4/B5 hostile peer:", json.dumps(summary, sort_keys=True))
    # B4: every forgery refused by the DHT nodes, the honest records kept
    assert summary["forgeries_injected"] == 6
    assert summary["forgeries_accepted"] == 0
    assert summary["honest_kept"] == 3
    # B5: it tried while the listed peers were matchmaking, and got nowhere
    assert summary["contested_join_attempts"] >= 2 and summary["state_attempts"] >= 2, summary
    assert summary["admissions"] == 0 and summary["state_downloads"] == 0
    assert summary["config_publish_refused"] == 1 and summary["config_hijacks"] == 0
    refused = sum(len(p.of("admission_refused")) for p in (a, b))
    assert refused >= 1, swarm.tails()
    for peer in (a, b):
        rounds = peer.of("outer_round")
        assert rounds and all(e["group_size"] <= 2 for e in rounds), rounds
        assert all(e["peer"] != hostile_id for e in peer.of("state_download"))
    assert any(e["group_size"] == 2 for e in a.of("outer_round")), swarm.tails()  # the listed peers did average
