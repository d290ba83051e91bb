"""Stopping peerd the way a terminal does, with real processes on 127.0.0.1: SIGINT (Ctrl-C) or SIGTERM
(``timeout``, ``kill -- -PGID``) to the command's whole process group, which also reaches every helper still in it.

Each command runs in a session of its own (as a shell runs a foreground job) and the signal goes to that group with
``os.killpg``. It must exit within :data:`EXIT_BOUND_S` with the documented code and leave none of its processes
behind: its DHT process, p2pd, the py-libp2p daemon, torch's shared-memory manager (collected before the signal:
orphans are reparented). Long-running commands stop cleanly with 0; the ones that wait for an answer exit
128 + the signal's number; a second signal exits at once with 130, without a traceback, and the checkpoint stays
valid.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import psutil
import pytest

from peerd.runtime.processes import REPEAT_WINDOW_S
from peerd.worker.checkpoint_file import load_checkpoint
from peerd.testing.localswarm import LOCAL, TINY, Peer, Swarm, peerd_cmd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: Longest wait for a signalled command (and each of its processes) to exit: generous, for a loaded 2-core machine;
#: the README promises seconds (20 s with an all-reduce in flight). The measured times are printed.
EXIT_BOUND_S = 60.0


@pytest.fixture
def endless(tmp_path: Path) -> Path:
    """The tiny test run without a round limit: the peer is still training when it is signalled."""
    path = tmp_path / "endless.toml"
    path.write_text(TINY.read_text().replace("max_outer_rounds = 2", "max_outer_rounds = 0"))
    assert path.read_text() != TINY.read_text()
    return path


@pytest.fixture
def silent_peer(tmp_path: Path):
    """The multiaddr of a "bootstrap node" that accepts TCP connections and never answers: a command given it as
    its initial peer waits on the network (until its DHT start-up times out, 30 s or more)."""
    from peerd.identity.key import load_or_create_identity

    peer_id = load_or_create_identity(tmp_path / "silent.key")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}/p2p/{peer_id}"


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _names(procs: list[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        try:
            out.append(" ".join(proc.cmdline()[:4]) or proc.name())
        except psutil.Error:
            out.append(f"{proc.pid} (gone)")
    return out


def _has_helper(pid: int, helper: str) -> bool:
    """Whether a process whose command line contains ``helper`` (p2pd, libp2p_daemon) runs under ``pid``."""
    for proc in _tree(pid)[1:]:
        try:
            if helper in " ".join(proc.cmdline()):
                return True
        except psutil.Error:
            pass
    return False


def _signal_group(swarm: Swarm, peer: Peer, signals: list[int], expected_rc: int, min_helpers: int = 2,
                  leader: Optional[subprocess.Popen] = None) -> float:
    """Send ``signals`` (back to back) to the process group of ``leader`` (default: the peer's process), as a
    terminal does; assert the peer exits with ``expected_rc`` and every process of its tree is gone within
    :data:`EXIT_BOUND_S`. Returns the seconds from the first signal to the last process gone."""
    leader = leader or peer.proc
    tree = _tree(leader.pid)
    assert len(tree) >= 1 + min_helpers, _names(tree)
    started = time.monotonic()
    for sig in signals:
        os.killpg(leader.pid, sig)
    rc = swarm.wait_exit(peer, EXIT_BOUND_S)
    exited = time.monotonic() - started
    _, alive = psutil.wait_procs(tree, timeout=EXIT_BOUND_S)
    gone = time.monotonic() - started
    assert not alive, f"still running {EXIT_BOUND_S} s after the signal: {_names(alive)}"
    assert rc == expected_rc, swarm.tails()
    print(f"{peer.name}: {'+'.join(signal.Signals(s).name for s in signals)} to the group -> exit {rc} after "
          f"{exited:.1f} s, all {len(tree)} processes gone after {gone:.1f} s ({_names(tree)})")
    return gone


def _join_args(tmp_path: Path, name: str, run_config: Path, *extra: str) -> list[str]:
    return ["join", "--run-id", f"signals-{name}", "--run-config", str(run_config), "--config", str(LOCAL),
            "--log-format", "json", "--identity", str(tmp_path / f"{name}.key"),
            "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"), *extra]


def _start(swarm: Swarm, name: str, argv: list[str], on_stdout: bool = False) -> Peer:
    """``argv`` as a managed process in its own session (stderr to ``<name>.log``), logging at INFO."""
    log = swarm.workdir / f"{name}.log"
    with open(log, "w") as stderr:
        proc = swarm.children.start(argv, stdout=stderr if on_stdout else subprocess.DEVNULL, stderr=stderr,
                                    env={**os.environ, "PEERD_LOGLEVEL": "INFO"})
    peer = Peer(name, proc, log)
    swarm.peers.append(peer)
    return peer


def _start_join(swarm: Swarm, tmp_path: Path, endless: Path, dht: str, transport: str) -> Peer:
    """A lone ``peerd join`` (the first peer of its run), once it completed an outer round (and checkpointed)."""
    name = f"{dht}-{transport}"
    peer = _start(swarm, name, peerd_cmd(*_join_args(tmp_path, name, endless, "--dht", dht, "--transport",
                                                      transport)))
    helper = "p2pd" if transport == "p2pd" else "libp2p_daemon"
    swarm.wait_for(lambda: peer.of("outer_round") and _has_helper(peer.proc.pid, helper), 240,
                   f"{name}: a first outer round (and its checkpoint)")
    return peer


def _check_join_after(peer: Peer, tmp_path: Path) -> str:
    log = peer.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    checkpoint = load_checkpoint(tmp_path / f"ckpt-{peer.name}" / f"signals-{peer.name}" / "state.safetensors")
    assert checkpoint is not None and checkpoint.metadata.get("outer_round", 0) >= 1, checkpoint
    return log


@pytest.mark.parametrize("dht, transport, sig", [
    ("inline", "p2pd", signal.SIGINT),
    ("process", "libp2p", signal.SIGTERM),
], ids=["inline-p2pd-sigint", "process-libp2p-sigterm"])
def test_join_stopped_through_its_process_group_leaves_no_process(swarm, tmp_path, endless, dht, transport, sig):
    peer = _start_join(swarm, tmp_path, endless, dht, transport)
    _signal_group(swarm, peer, [sig], 0)
    log = _check_join_after(peer, tmp_path)
    assert peer.of("leave"), log[-3000:]


def test_a_second_sigint_during_a_slow_shutdown_exits_at_once(swarm, tmp_path, endless):
    """The DHT process is frozen (SIGSTOP), so the shutdown that the first SIGINT starts cannot finish soon; the
    second SIGINT, sent once the first was received, exits at once: 130, no traceback, no process left (the frozen
    one included), the checkpoint still valid."""
    peer = _start_join(swarm, tmp_path, endless, "process", "p2pd")
    dht = [c for c in psutil.Process(peer.proc.pid).children() if c.cmdline() == peer.proc.args]
    assert len(dht) == 1, _names(_tree(peer.proc.pid))  # the forked DHT process runs the daemon's command line
    tree = _tree(peer.proc.pid)
    dht[0].suspend()
    os.killpg(peer.proc.pid, signal.SIGINT)
    swarm.wait_for(lambda: "received SIGINT" in peer.log.read_text(), 60, "the first SIGINT to be received")
    time.sleep(REPEAT_WINDOW_S)  # sooner, the same signal counts as the first one delivered twice
    started = time.monotonic()
    os.killpg(peer.proc.pid, signal.SIGINT)
    rc = swarm.wait_exit(peer, EXIT_BOUND_S)
    _, alive = psutil.wait_procs(tree, timeout=EXIT_BOUND_S)
    assert not alive, f"still running: {_names(alive)}"
    assert rc == 130, swarm.tails()
    log = _check_join_after(peer, tmp_path)
    assert "SIGINT again: exiting now" in log, log[-3000:]
    print(f"second SIGINT: exit {rc} after {time.monotonic() - started:.1f} s, all {len(tree)} processes gone")


def test_join_under_timeout_stops_cleanly_when_the_time_is_up(swarm, tmp_path, endless):
    """``timeout`` sends SIGTERM to its child and then to its whole group: the DHT process and p2pd included."""
    name = "timeout"
    wrapper = _start(swarm, name, ["timeout", "--preserve-status", "3600",
                                   *peerd_cmd(*_join_args(tmp_path, name, endless))])
    swarm.wait_for(lambda: wrapper.of("outer_round") and _has_helper(wrapper.proc.pid, "p2pd"), 240,
                   "a first outer round under timeout")
    tree = _tree(wrapper.proc.pid)
    started = time.monotonic()
    wrapper.proc.send_signal(signal.SIGALRM)  # what timeout gets when its time is up
    rc = swarm.wait_exit(wrapper, EXIT_BOUND_S)
    _, alive = psutil.wait_procs(tree, timeout=EXIT_BOUND_S)
    assert not alive, f"still running: {_names(alive)}"
    assert rc == 0, swarm.tails()  # --preserve-status: peerd's own exit code
    assert wrapper.of("leave")
    print(f"timeout: exit {rc}, all {len(tree)} processes gone after {time.monotonic() - started:.1f} s")


def test_bootstrap_and_dashboard_stopped_through_their_process_groups(swarm, tmp_path):
    maddr = swarm.start_bootstrap()
    bootstrap = Peer("bootstrap", swarm._bootstrap, tmp_path / "bootstrap.err")
    swarm.peers.append(bootstrap)
    dashboard = _start(swarm, "dashboard", peerd_cmd(
        "dashboard", "--run-id", "signals-dashboard", "--initial-peers", maddr, "--dashboard-port", "0",
        "--checkpoint-dir", str(tmp_path / "dash")), on_stdout=True)
    swarm.wait_for(lambda: "dashboard of run" in dashboard.log.read_text(), 120, "the dashboard to serve")
    _signal_group(swarm, dashboard, [signal.SIGTERM], 0)
    _signal_group(swarm, bootstrap, [signal.SIGINT], 0)
    for peer in (dashboard, bootstrap):
        assert "Traceback" not in peer.log.read_text(), peer.log.read_text()[-3000:]


WAITING_COMMANDS = {
    "status": lambda run, peer: ["status", "--run-id", run, "--initial-peers", peer],
    "doctor": lambda run, peer: ["doctor", "--run-id", run, "--initial-peers", peer, "--config", str(LOCAL)],
    "eval": lambda run, peer: ["eval", "--run-id", run, "--initial-peers", peer],
    "generate": lambda run, peer: ["generate", "--run-id", run, "--initial-peers", peer, "--prompt", "To be"],
}


@pytest.mark.parametrize("command, transport, sig", [
    ("status", "p2pd", signal.SIGINT),
    ("status", "libp2p", signal.SIGINT),
    ("doctor", "p2pd", signal.SIGTERM),
    ("eval", "p2pd", signal.SIGTERM),
    ("generate", None, signal.SIGTERM),  # no --transport flag: the default (p2pd where it runs)
], ids=["status-p2pd-sigint", "status-libp2p-sigint", "doctor-p2pd-sigterm", "eval-p2pd-sigterm",
        "generate-sigterm"])
def test_a_command_waiting_on_the_network_is_interrupted_through_its_process_group(swarm, silent_peer, command,
                                                                                   transport, sig):
    argv: Callable[[str, str], list[str]] = WAITING_COMMANDS[command]
    extra = ["--transport", transport] if transport else []
    peer = _start(swarm, command, peerd_cmd(*argv("signals-waiting", silent_peer), *extra))
    helper = "libp2p_daemon" if transport == "libp2p" else "p2pd"
    swarm.wait_for(lambda: _has_helper(peer.proc.pid, helper), 120, f"{command} to start its {helper}")
    _signal_group(swarm, peer, [sig], 128 + sig, min_helpers=1)
    log = peer.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert f"interrupted by {signal.Signals(sig).name}" in log, log[-3000:]
