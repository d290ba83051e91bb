"""A slow and a garbage-sending worker among real peers (RELIABILITY rows A5, B2), one process per peer.

The misbehaving worker gets its schedule through ``PEERD_FAULTS``; its counted ``fault`` events prove the injection
fired. The honest workers must finish the round without it, ban it, and keep bit-identical, finite theta_outer.
B2's worker runs through tests/integration/nan_on_the_wire.py: an unmodified peer cannot send NaN (its own codec
refuses to encode it), a hostile one can.
"""

import math
import sys
from pathlib import Path

import pytest

from peerd.testing.faults import Faults
from peerd.identity.key import load_or_create_identity
from peerd.testing.localswarm import LOCAL
from tests.integration.test_diloco_swarm import _config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SENDER_TIMEOUT_S = 3.0
NAN_ON_THE_WIRE = Path(__file__).with_name("nan_on_the_wire.py")


def _hostile_run(swarm, tmp_path, run_id, faults, monkeypatch=None):
    """3 honest workers and 1 worker with ``faults``, 3 outer rounds; returns (honest, hostile, hostile PeerID).
    With ``monkeypatch`` the hostile worker is tests/integration/nan_on_the_wire.py (NaN past its own codec)."""
    config = _config(tmp_path, f"{run_id}.toml", max_outer_rounds=3, matchmaking_timeout_s=10, request_timeout_s=2,
                     sender_timeout_s=SENDER_TIMEOUT_S, reducer_timeout_s=2 * SENDER_TIMEOUT_S + 2)
    hostile_id = load_or_create_identity(tmp_path / "hostile.key")  # the file the hostile peer will use
    swarm.start_bootstrap()
    honest = [swarm.start_peer(f"p{i}", run_id, config) for i in range(3)]
    if monkeypatch is None:
        hostile = swarm.start_peer("hostile", run_id, config, env=faults.environ())
    else:  # the same arguments as Swarm.start_peer, through the launcher; the child inherits the environment
        for name, value in faults.environ().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("PEERD_LOGLEVEL", "INFO")
        hostile = swarm.start_process("hostile", [
            sys.executable, str(NAN_ON_THE_WIRE), "join", "--run-id", run_id, "--config", str(LOCAL),
            "--log-format", "json", "--identity", str(tmp_path / "hostile.key"),
            "--checkpoint-dir", str(tmp_path / "ckpt-hostile"), "--initial-peers", swarm.bootstrap_maddr,
            "--run-config", str(config)])
        for name in faults.environ():
            monkeypatch.delenv(name)
    for peer in honest:
        assert swarm.wait_exit(peer, 200) == 0, swarm.tails()
    # the hostile peer may still be finishing its rounds alone: not waited for (its fault events are flushed as they
    # fire, and the swarm fixture kills it)
    return honest, hostile, hostile_id


def _round(peer, r):
    events = [e for e in peer.of("outer_round") if e["outer_round"] == r]
    assert events, (r, peer.of("outer_round"))
    return events[0]


def _bans_of(peer, who):
    return [e for e in peer.of("ban") if e.get("peer") == who]


def test_a5_stalled_sender_is_left_out_within_the_sender_timeout_and_banned(swarm, tmp_path):
    stall_s = 3 * SENDER_TIMEOUT_S
    honest, hostile, hostile_id = _hostile_run(swarm, tmp_path, "a5",
                                               Faults().stall(at_round=2, seconds=stall_s))
    fired = [e for e in hostile.of("fault") if e.get("action") == "stall"]
    assert fired and all(e["outer_round"] == 2 for e in fired), hostile.of("fault")  # the injection fired
    rounds = [_round(p, 2) for p in honest]
    for peer, r2 in zip(honest, rounds):
        assert r2["group_size"] == 4, r2  # the staller was in the group: the round really waited on it
        assert r2["allreduce_s"] <= SENDER_TIMEOUT_S + 0.5, r2  # RELIABILITY A5
    for r in (2, 3):
        assert len({p.digests().get(r) for p in honest}) == 1 and all(p.digests().get(r) for p in honest), r
    allreduce_s = ", ".join(f"{r['allreduce_s']:.2f}" for r in rounds)
    round_s = ", ".join(f"{r['round_s']:.2f}" for r in rounds)
    print(f"FIGURE A5: silent {stall_s:.0f} s after half of each part's payload (fired {len(fired)}x) "
          f"in round 2; honest all-reduce {allreduce_s} s, round {round_s} s vs sender_timeout_s "
          f"{SENDER_TIMEOUT_S:.1f} s (+0.5 s budget); staller banned by "
          f"{sum(bool(_bans_of(p, hostile_id)) for p in honest)}/3; honest digests agree after rounds 2 and 3")
    for peer in honest:
        assert _bans_of(peer, hostile_id), (peer.name, peer.of("ban"), peer.of("exclude"))


def test_b2_nan_pseudo_gradient_is_excluded_banned_and_theta_stays_finite(swarm, tmp_path, monkeypatch):
    honest, hostile, hostile_id = _hostile_run(swarm, tmp_path, "b2", Faults().corrupt(at_round=2, how="nan"),
                                               monkeypatch)
    fired = [e for e in hostile.of("fault") if e.get("action") == "corrupt"]
    # One firing per attempt of round 2: on a slow machine the hostile peer may retry a failed round 2, and every
    # attempt must put its NaN on the wire (never into its own state).
    assert fired and all(e["how"] == "nan" and e["outer_round"] == 2 and e["where"] == "wire" for e in fired), (
        hostile.of("fault"))
    for peer in honest:
        excluded = {p for e in peer.of("outer_round") for p in (e.get("excluded") or {})}
        assert hostile_id in excluded or any(e.get("peer") == hostile_id for e in peer.of("exclude")), (
            peer.name, peer.of("outer_round"), peer.of("exclude"))
        assert _bans_of(peer, hostile_id), (peer.name, peer.of("ban"))
        for r in (2, 3):
            loss = _round(peer, r)["eval_nats_per_byte"]
            assert loss is not None and math.isfinite(loss), (peer.name, r, loss)
    for r in (2, 3):
        assert len({p.digests().get(r) for p in honest}) == 1 and all(p.digests().get(r) for p in honest), r
    r2, losses = _round(honest[0], 2), [_round(p, r)["eval_nats_per_byte"] for p in honest[:1] for r in (1, 2, 3)]
    reasons = sorted({e["reason"] for p in honest for e in p.of("exclude") if e.get("peer") == hostile_id})
    print(f"FIGURE B2: NaN slices on the wire from 1 of 4 peers in round 2 (fired {len(fired)}x); excluded and banned "
          f"by {sum(bool(_bans_of(p, hostile_id)) for p in honest)}/3 honest peers ({'; '.join(reasons)}); round 2: "
          f"group {r2['group_size']}, all-reduce {r2['allreduce_s']:.2f} s; honest digests agree after rounds 2 and 3; "
          f"eval after rounds 1, 2, 3: {', '.join(f'{x:.4f}' for x in losses)} nats/byte (finite)")
