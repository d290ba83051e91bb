"""A volunteer's daemon end to end: a real run of two peers, one of them started the way the Docker image starts it
(everything from PEERD_* variables, state under the image's /data volume, remapped into tmp) and under a fake
systemd (a NOTIFY_SOCKET this test listens on, WATCHDOG_USEC=2 s), with metrics, an upload cap, and pause/resume
through the control socket. The tests run in order on one module-scoped swarm.
"""

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from peerd.identity.key import load_or_create_identity
from peerd.testing.localswarm import TINY, Peer, Swarm, peerd_cmd
from tests.dockerfile import DOCKERFILE, exec_form, image_env

# generous guards: these take 10-30 s each on an idle machine, several times that on a shared, overloaded one
# one xdist group: the tests share the module's daemon in order (the health check and SIGTERM tests need the daemon
# the earlier ones waited for; a worker of their own would start a fresh one and probe it before it is up)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("volunteer_daemon"), pytest.mark.timeout(420)]

RUN = "volunteer"
UPLOAD_CAP_MB_S = 2.0


class NotifyListener:
    """The systemd side of the notify protocol: collects (time, message) datagrams in a thread."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            for line in data.decode().splitlines():
                self.messages.append((time.time(), line))

    def times(self, line: str) -> list[float]:
        return [t for t, m in list(self.messages) if m == line]

    def close(self) -> None:
        self._closed = True
        self._thread.join(2)
        self.sock.close()


def _container_env(data: Path) -> dict[str, str]:
    """The image's PEERD_* environment with /data moved into tmp and every address on 127.0.0.1."""
    env = {k: v for k, v in image_env(DOCKERFILE).items() if k.startswith("PEERD_") or k == "HOME"}
    env = {k: v.replace("/data", str(data)) for k, v in env.items()}
    assert env["PEERD_HOST_MADDRS"] == "/ip4/0.0.0.0/tcp/31337" and env["PEERD_METRICS_HOST"] == "0.0.0.0"
    env.update(PEERD_HOST_MADDRS="/ip4/127.0.0.1/tcp/0", PEERD_METRICS_HOST="127.0.0.1")
    # what local-test.toml sets for the other peers, as variables
    env.update(PEERD_DEVICE="cpu", PEERD_THREADS="1", PEERD_NAT_PORT_MAP="false", PEERD_STATUS_INTERVAL_S="1",
               PEERD_STATUS_TTL_S="6", PEERD_LOG_EVERY_STEPS="5")
    return env


@pytest.fixture(scope="module")
def volunteer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("volunteer")
    swarm = Swarm(tmp)
    listener = NotifyListener(tmp / "notify.sock")
    try:
        maddr = swarm.start_bootstrap()
        run_config = tmp / "endless.toml"
        run_config.write_text(TINY.read_text().replace("max_outer_rounds = 2", "max_outer_rounds = 0"))
        data = tmp / "data"
        env = {**_container_env(data), "PEERD_RUN_ID": RUN, "PEERD_INITIAL_PEERS": maddr, "PEERD_METRICS_PORT": "0",
               "PEERD_UPLOAD_LIMIT_MB_S": str(UPLOAD_CAP_MB_S), "PEERD_LOGLEVEL": "INFO"}
        log = tmp / "a.log"
        with open(log, "w") as stderr:
            # the image's CMD is ["join"]; compose's first peer adds --run-config; the test reads JSON logs
            proc = subprocess.Popen(
                peerd_cmd("join", "--run-config", str(run_config), "--log-format", "json"),
                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                env={**os.environ, **env, "NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "2000000"},
            )
        a = Peer("a", proc, log)
        swarm.peers.append(a)
        b = swarm.start_peer("b", RUN, run_config)
        yield SimpleNamespace(swarm=swarm, a=a, b=b, env=env, listener=listener, maddr=maddr, data=data,
                              a_id=None)
    finally:
        swarm.close()
        listener.close()


def _client(v, *args, timeout=150):
    """A peerd client command in A's environment (as `docker exec` or the HEALTHCHECK would run it)."""
    return subprocess.run(peerd_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **v.env})


def _scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("peerd_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_ready_then_watchdog_pings(volunteer):
    v = volunteer
    v.swarm.wait_for(lambda: v.listener.times("READY=1"), 120, "READY=1 from the daemon")
    ready = v.listener.times("READY=1")[0]
    v.swarm.wait_for(lambda: len([t for t in v.listener.times("WATCHDOG=1") if t > ready]) >= 4, 30,
                     "WATCHDOG=1 after READY=1")
    pings = [t for t in v.listener.times("WATCHDOG=1") if t > ready]
    gaps = [b - a for a, b in zip([ready] + pings, pings)]
    # sent every WATCHDOG_USEC / 2 = 1 s once running (systemd arms the watchdog at READY=1), never late enough to
    # trip the 2 s watchdog
    assert max(gaps) < 1.9, gaps
    assert any(m.startswith("STATUS=") for _, m in v.listener.messages)


def test_metrics_scraped_during_a_real_run(volunteer):
    v = volunteer
    v.swarm.wait_for(lambda: any(e["group_size"] == 2 for e in v.a.of("outer_round")), 120,
                     "an outer round of both peers")
    port = v.a.of("metrics")[0]["port"]
    deadline = time.time() + 30
    m = _scrape(port)
    while m.get("peerd_peers_seen", 0) < 2 and time.time() < deadline:  # refreshed every 5 s
        time.sleep(1)
        m = _scrape(port)
    assert m["peerd_peers_seen"] >= 2, m
    assert m["peerd_outer_round_seconds_count"] >= 1 and m["peerd_allreduce_seconds_count"] >= 1
    assert m["peerd_outer_rounds_total"] >= 1 and m["peerd_outer_round"] >= 1
    assert m["peerd_bytes_sent_total"] > 100_000 and m["peerd_bytes_received_total"] > 100_000
    assert 0 < m["peerd_loss"] < 6 and 0 < m["peerd_eval_loss"] < 6 and m["peerd_tokens_per_second"] > 0
    assert m["peerd_group_size"] >= 1 and m["peerd_bans_total"] == 0 and "peerd_failed_rounds_total" in m
    assert m['peerd_bandwidth_limit_bytes_per_second{direction="upload"}'] == UPLOAD_CAP_MB_S * 1e6
    assert 0 < m['peerd_achieved_bytes_per_second{direction="upload"}'] <= 1.1 * UPLOAD_CAP_MB_S * 1e6, m


def test_healthcheck_of_the_image(volunteer):
    v = volunteer
    health = exec_form(DOCKERFILE, "HEALTHCHECK")  # ["peerd", "health"]
    ok = _client(v, *health[1:])
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("healthy: run volunteer:") and len(ok.stdout.strip().splitlines()) == 1
    stale = _client(v, *health[1:], "--max-age-s", "0.001")
    assert stale.returncode == 1 and stale.stdout == ""
    assert len(stale.stderr.strip().splitlines()) == 1 and "no round completed or joined" in stale.stderr
    # the control socket lives on the volume, with mode 0600
    sock = v.data / "checkpoints" / "peerd.sock"
    assert oct(sock.stat().st_mode & 0o777) == "0o600"


def test_pause_leaves_rounds_and_resume_rejoins(volunteer):
    v = volunteer
    a_id = load_or_create_identity(v.data / "identity.key")  # the existing key: A's PeerID
    paused = _client(v, "pause")
    assert paused.returncode == 0 and paused.stdout.startswith("paused"), paused.stderr
    v.swarm.wait_for(lambda: v.a.of("paused"), 60, "A to leave its round and pause")
    rounds_a = len(v.a.of("outer_round")) + len(v.a.of("round_failed"))
    rounds_b = len(v.b.of("outer_round"))

    status = _client(v, "status", "--run-id", RUN, "--initial-peers", v.maddr, "--json")
    assert status.returncode == 0, status.stderr
    peers = json.loads(status.stdout)["peers"]
    assert peers[a_id]["role"] == "paused", peers
    health = _client(v, "health")
    assert health.returncode == 0 and "paused" in health.stdout

    # the swarm goes on without A; A starts no round while paused
    v.swarm.wait_for(lambda: len(v.b.of("outer_round")) >= rounds_b + 2, 90, "B to train on alone")
    assert len(v.a.of("outer_round")) + len(v.a.of("round_failed")) == rounds_a
    assert not [e for e in v.a.of("inner") if e["time"] > v.a.of("paused")[-1]["time"]]

    resumed = _client(v, "resume")
    assert resumed.returncode == 0 and resumed.stdout.startswith("resumed"), resumed.stdout + resumed.stderr
    v.swarm.wait_for(lambda: v.a.of("resumed") and len(v.a.of("outer_round")) > rounds_a, 120,
                     "A to rejoin and complete an outer round")


def test_sigterm_sends_stopping_and_leaves_cleanly(volunteer):
    v = volunteer
    v.a.proc.send_signal(signal.SIGTERM)
    assert v.swarm.wait_exit(v.a, 60) == 0
    ready = v.listener.times("READY=1")[0]
    stopping = v.listener.times("STOPPING=1")
    assert stopping and stopping[0] > ready
    leave = v.a.of("leave")
    assert leave
    # the daemon's last line: every byte of its streams, at least the averaged tensors its leave line counts
    reports = v.a.of("bandwidth")
    assert len(reports) == 1, reports
    bandwidth = reports[0]
    why = f"{bandwidth} after {leave}; log tail:\n{v.a.log.read_text()[-6000:]}"
    assert bandwidth["upload"]["bytes"] >= leave[-1]["bytes_sent"] > 0, why
    assert bandwidth["upload"]["limit_bytes_per_s"] == UPLOAD_CAP_MB_S * 1e6, why
    assert bandwidth["upload"]["achieved_bytes_per_s"] <= 1.1 * UPLOAD_CAP_MB_S * 1e6
    assert not (v.data / "checkpoints" / "peerd.sock").exists()
    gone = _client(v, "health")
    assert gone.returncode == 1 and "no peerd daemon running" in gone.stderr
    assert len(gone.stderr.strip().splitlines()) == 1
