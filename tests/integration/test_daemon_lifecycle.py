"""A daemon's hold on its machine-local state, with real processes on 127.0.0.1.

RELIABILITY A13: a second daemon given an identity file that a running daemon holds exits 1 at once, naming the
file and the holder's pid (two daemons with one PeerID would dial themselves or train alone, silently).
RELIABILITY A12: a SIGKILLed worker (what the OOM killer does) leaves no process behind (its DHT process and p2pd
die with it), and a worker restarted on the same checkpoint dir serves the control socket itself.
"""

import json
import signal
import subprocess
import time

import psutil
import pytest

from peerd.testing.localswarm import LOCAL, TINY, peerd_cmd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = "lifecycle"


def test_a13_a_second_daemon_on_a_held_identity_exits_1_naming_the_file_and_the_holder(swarm, tmp_path):
    swarm.start_bootstrap()
    holder = swarm._bootstrap.pid
    identity = tmp_path / "bootstrap.key"
    second = swarm.start_process("second", peerd_cmd(
        "bootstrap", "--config", str(LOCAL), "--identity", str(identity), "--checkpoint-dir", str(tmp_path / "other")))
    started = time.monotonic()
    assert swarm.wait_exit(second, 60) == 1
    elapsed = time.monotonic() - started
    errors = [line for line in second.log.read_text().splitlines() if "ERROR" in line or "error" in line]
    assert len(errors) == 1, second.log.read_text()
    assert str(identity) in errors[0] and f"pid {holder}" in errors[0] and "--identity" in errors[0], errors[0]
    assert swarm._bootstrap.poll() is None  # the first daemon is untouched
    # refused before any DHT node starts: python + imports only (a few seconds on an idle machine)
    print(f"A13: second daemon refused in {elapsed:.1f} s")
    assert not (tmp_path / "other" / "bootstrap.key").exists()


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _control(checkpoint_dir, *args):
    out = subprocess.run(peerd_cmd(*args, "--checkpoint-dir", str(checkpoint_dir), "--json"), capture_output=True,
                         text=True, timeout=60)
    return out.returncode, (json.loads(out.stdout) if out.stdout.strip() else {}), out.stderr


@pytest.mark.long
def test_a12_a_sigkilled_worker_leaves_no_process_and_its_successor_serves_the_control_socket(swarm, tmp_path):
    swarm.start_bootstrap()
    endless = tmp_path / "endless.toml"  # the worker must still be running when it is killed
    endless.write_text(TINY.read_text().replace("max_outer_rounds = 2", "max_outer_rounds = 0"))
    assert endless.read_text() != TINY.read_text()
    first = swarm.start_peer("w", RUN, endless)
    checkpoint_dir = tmp_path / "ckpt-w"
    swarm.wait_for(lambda: first.of("control") and any("p2pd" in p.name() for p in _tree(first.proc.pid)), 120,
                   "the worker's control socket and its p2pd")
    swarm.wait_for(lambda: first.of("outer_round"), 180, "the worker to complete an outer round (and checkpoint)")
    swarm.wait_for(lambda: _control(checkpoint_dir, "health")[1].get("pid") == first.proc.pid, 60,
                   "the first worker to answer on its control socket")
    tree = _tree(first.proc.pid)  # collected before the kill: afterwards the orphans have another parent
    assert first.proc.poll() is None
    assert len(tree) >= 3, [p.name() for p in tree]  # the daemon, its DHT process, p2pd

    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(map(_alive, tree)):
        time.sleep(0.1)
    assert not [(p.pid, p.name()) for p in tree if _alive(p)], "processes of the killed worker still run"

    second = swarm.start_peer("w", RUN, endless)
    assert second.proc.pid != first.proc.pid
    swarm.wait_for(lambda: second.of("control"), 120, "the restarted worker to serve its control socket")
    assert "another peerd daemon" not in second.log.read_text()
    swarm.wait_for(lambda: second.of("resume"), 120, "the restarted worker to resume from its checkpoint")
    assert second.of("resume")[0]["outer_round"] >= 1
    rc, health, err = _control(checkpoint_dir, "health")
    assert health.get("pid") == second.proc.pid, (rc, health, err)
    rc, paused, err = _control(checkpoint_dir, "pause")
    assert rc == 0 and paused["pid"] == second.proc.pid and paused["paused"], (paused, err)
    swarm.wait_for(lambda: second.of("control_pause"), 30, "the new worker to log the pause")
    rc, resumed, err = _control(checkpoint_dir, "resume")
    assert rc == 0 and resumed["pid"] == second.proc.pid and not resumed["paused"], (resumed, err)
