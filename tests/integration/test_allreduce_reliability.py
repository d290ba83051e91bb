"""Butterfly all-reduce among real averaging peers (peerd.testing.avgpeer, one process each; RELIABILITY rows A1 and A4).

A1: a clean all-reduce of N = 4 and N = 8 peers leaves every peer with the weighted mean of the initial vectors,
bit-identical on every peer. A4: a reducer is SIGKILLed with its part sealed, before it answers anyone (fault
phase ``reduce``): the attempt fails for every survivor, the survivors retry once among themselves, and every
element of every survivor ends equal to the survivors' weighted mean (reference) or to its own value (local).
"""

import json
import sys

import pytest
import torch

from peerd.testing.avgpeer import initial_vector
from peerd.testing.faults import ENV, Faults
from peerd.testing.localswarm import Peer, Swarm

pytestmark = [pytest.mark.slow]

TOLERANCE = 1e-5  # fp32, compression none


def _start(swarm: Swarm, tmp_path, index: int, n: int, numel: int, env: dict | None = None, **flags) -> Peer:
    argv = [sys.executable, "-m", "peerd.testing.avgpeer", "--index", str(index), "--expect", str(n),
            "--topology", "allreduce", "--rounds", "1", "--numel", str(numel), "--compression", "none",
            "--weight", str(float(index + 1)), "--out", str(tmp_path / f"a{index}.jsonl"),
            "--initial-peers", swarm.bootstrap_maddr, "--start-timeout-s", "150", "--member-ttl-s", "6",
            "--timeout-s", "15", "--matchmaking-timeout-s", "20"]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    if env:  # `env` execs the peer in place: same pid, so the swarm still kills its whole process group
        argv = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
    return swarm.start_process(f"a{index}", argv)


def _records(tmp_path, i: int, event: str = "round") -> list[dict]:
    path = tmp_path / f"a{i}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["event"] == event]


def _exact_mean(indices, numel: int) -> torch.Tensor:
    """sum_i w_i x_i / sum_i w_i in float64 (w_i = i + 1, avgpeer's --weight here)."""
    total = sum(float(i + 1) for i in indices)
    return sum(float(i + 1) * initial_vector(i, numel).double() for i in indices) / total


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n, numel", [(4, 262_144), (8, 131_072)])
def test_a1_clean_allreduce_every_peer_holds_the_weighted_mean(swarm, tmp_path, n, numel):
    swarm.start_bootstrap()
    peers = [_start(swarm, tmp_path, i, n, numel) for i in range(n)]
    for peer in peers:
        assert swarm.wait_exit(peer, 240) == 0, swarm.tails()
    finals = [torch.load(tmp_path / f"a{i}.jsonl.final.pt") for i in range(n)]
    for i in range(n):
        (record,) = _records(tmp_path, i)
        assert record["ok"] and record["group_size"] == n and record["attempts"] == 1, record
    reference = _exact_mean(range(n), numel)
    error = max(float((f.double() - reference).abs().max()) for f in finals)
    identical = all(torch.equal(f, finals[0]) for f in finals)
    seconds = max(_records(tmp_path, i)[0]["seconds"] for i in range(n))
    print(f"A1 N={n} numel={numel}: max abs error vs exact weighted mean = {error:.3g}, "
          f"bit-identical on all {n} peers: {identical}, all-reduce {seconds:.2f} s (slowest peer)")
    assert error <= TOLERANCE
    assert identical


@pytest.mark.timeout(300)
def test_a4_reducer_killed_before_answering_survivors_retry_and_hold_their_mean(swarm, tmp_path):
    n, numel, victim = 4, 100_000, 2
    swarm.start_bootstrap()
    kill = Faults().kill(at_round=1, phase="reduce").to_json()
    peers = [_start(swarm, tmp_path, i, n, numel, env={ENV: kill} if i == victim else None, attempts=2)
             for i in range(n)]
    survivors = [i for i in range(n) if i != victim]
    for i in survivors:
        assert swarm.wait_exit(peers[i], 240) == 0, swarm.tails()
    assert swarm.wait_exit(peers[victim], 10) == -9, swarm.tails()

    fired = [e for e in peers[victim].of("fault") if e.get("action") == "kill"]
    # the injection fired exactly once, as a reducer that had received the other n - 1 members' parts
    assert len(fired) == 1 and fired[0]["phase"] == "reduce" and fired[0]["senders"] == n - 1, fired
    assert not _records(tmp_path, victim), "the victim must die before it finishes its round"
    victim_id = _records(tmp_path, victim, "start")[0]["peer"]

    reference = _exact_mean(survivors, numel)
    fractions = []
    for i in survivors:
        (record,) = _records(tmp_path, i)
        # the first attempt failed for every survivor, on the dead reducer; the retry among the survivors succeeded
        assert record["ok"] and record["attempts"] == 2 and record["group_size"] == n - 1, record
        assert len(record["failed_attempts"]) == 1 and victim_id in record["failed_attempts"][0], record
        assert victim_id not in record["members"]
        final = torch.load(tmp_path / f"a{i}.jsonl.final.pt").double()
        is_reference = (final - reference).abs() <= TOLERANCE
        is_local = ~is_reference & ((final - initial_vector(i, numel).double()).abs() <= TOLERANCE)
        fractions.append((float(is_reference.double().mean()), float(is_local.double().mean())))
        error = float((final - reference).abs().max())
        print(f"A4 survivor {i}: {fractions[-1][0]:.2%} of elements = reference (survivors' weighted mean, max abs "
              f"error {error:.3g}), {fractions[-1][1]:.2%} = local, after attempts={record['attempts']}; round incl. "
              f"the failed attempt and the retry {record['seconds']:.2f} s")
    assert all(ref + local == 1.0 for ref, local in fractions)  # 100% in {reference, local}
    assert all(ref == 1.0 for ref, _ in fractions)  # and with the retry: all of it the survivors' mean
    finals = [torch.load(tmp_path / f"a{i}.jsonl.final.pt") for i in survivors]
    assert all(torch.equal(f, finals[0]) for f in finals)
