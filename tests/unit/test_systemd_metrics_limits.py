"""systemd notify messages and unit rendering, Prometheus metrics from events, compute limits, node config fields."""

import asyncio
import os
import socket
import types
import urllib.request
from pathlib import Path

import pytest

from peerd.config import ConfigError, NodeConfig, load_node_config
from peerd.service.limits import apply_cpu_threads, apply_gpu_memory_fraction
from peerd.service.metrics import Metrics
from peerd.service.systemd import Notifier, render_unit, systemd_quote, watchdog_interval_s, watchdog_loop

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]


# -------------------------------------------------------------------------------------------------------- notify


def _listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_notify_to_a_path_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    listener = _listener(path)
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.notify("READY=1", "STATUS=joined run x")
    assert listener.recv(4096) == b"READY=1\nSTATUS=joined run x"
    assert notifier.status("a\nb")
    assert listener.recv(4096) == b"STATUS=a b"
    notifier.close()
    listener.close()


def test_notify_to_an_abstract_socket():
    name = f"peerd-test-{os.getpid()}"
    listener = _listener("\0" + name)
    notifier = Notifier("@" + name)
    assert notifier.notify("WATCHDOG=1")
    assert listener.recv(4096) == b"WATCHDOG=1"
    notifier.close()
    listener.close()


def test_without_notify_socket_nothing_is_sent_and_failures_never_raise(tmp_path):
    assert Notifier.from_env({}).notify("READY=1") is False
    broken = Notifier(str(tmp_path / "nobody-listens.sock"))
    assert broken.notify("READY=1") is False  # logged once, not raised
    assert broken.notify("READY=1") is False


@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    ({"WATCHDOG_USEC": "30000000"}, 30.0),
    ({"WATCHDOG_USEC": "abc"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "4242"}, 2.0),  # our pid is 4242 below
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
])
def test_watchdog_interval(environ, expected):
    assert watchdog_interval_s(environ, pid=4242) == expected


def test_watchdog_pings_at_half_the_interval(tmp_path):
    path = str(tmp_path / "notify.sock")
    listener = _listener(path)
    listener.setblocking(False)

    async def main():
        task = asyncio.ensure_future(watchdog_loop(Notifier(path), timeout_s=0.2))
        await asyncio.sleep(0.55)
        task.cancel()

    asyncio.run(main())
    pings = []
    while True:
        try:
            pings.append(listener.recv(100))
        except BlockingIOError:
            break
    assert pings and set(pings) == {b"WATCHDOG=1"}
    assert 5 <= len(pings) <= 7, pings  # at 0, 0.1, ..., 0.5 s


# ----------------------------------------------------------------------------------------------------------- unit


def test_unit_file_contract():
    unit = render_unit(["/opt/peerd/venv/bin/peerd", "join", "--run-id", "r1", "--config", "/etc/peerd/node.toml"],
                       user="volunteer", watchdog_s=90)
    lines = set(unit.splitlines())
    for line in ("Type=notify", "Restart=on-failure", "WatchdogSec=90", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "StateDirectory=peerd", "User=volunteer", "ProtectHome=yes",
                 "ExecStart=/opt/peerd/venv/bin/peerd join --run-id r1 --config /etc/peerd/node.toml",
                 "Environment=PEERD_CHECKPOINT_DIR=/var/lib/peerd/checkpoints", "WantedBy=multi-user.target",
                 # unattended: restarts never stop, spaced out by a back-off; a usage error (exit 2) is not retried
                 "StartLimitIntervalSec=0", "RestartSec=15", "RestartSteps=8", "RestartMaxDelaySec=30min",
                 "RestartPreventExitStatus=2"):
        assert line in lines, line
    # the unit's environment variables are real node config keys
    env = dict(l.split("=", 2)[1:] for l in lines if l.startswith("Environment=PEERD_"))
    node = load_node_config(None, environ=env)
    assert node.checkpoint_path == Path("/var/lib/peerd/checkpoints")
    assert str(node.control_socket_path) == "/var/lib/peerd/checkpoints/peerd.sock"


def test_shipped_unit_is_the_rendered_one():
    shipped = (REPO / "deploy" / "systemd" / "peerd.service").read_text()
    assert shipped == render_unit(["/opt/peerd/venv/bin/peerd", "join", "--run-id", "shakespeare-small",
                                   "--config", "/etc/peerd/node.toml"])


def test_unit_rendering_refuses_bad_input_and_quotes_arguments():
    with pytest.raises(ValueError, match="absolute"):
        render_unit(["peerd", "join"])
    with pytest.raises(ValueError, match="user"):
        render_unit(["/usr/bin/peerd"], user="Bad User")
    with pytest.raises(ValueError, match="WatchdogSec"):
        render_unit(["/usr/bin/peerd"], watchdog_s=1)
    assert systemd_quote("/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW") == "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW"
    assert systemd_quote("/path with space/x") == '"/path with space/x"'
    assert systemd_quote("100%$HOME") == '"100%%$$HOME"'


# -------------------------------------------------------------------------------------------------------- metrics


def _scrape(metrics: Metrics) -> dict[str, float]:
    from prometheus_client import generate_latest

    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_follow_events():
    report = {"upload": {"bytes": 1234, "achieved_bytes_per_s": 2e6, "limit_bytes_per_s": 2e6},
              "download": {"bytes": 99, "achieved_bytes_per_s": None, "limit_bytes_per_s": None},
              "uplink": {"bytes_per_s": None, "measured": True, "peaks_bytes_per_s": []}}
    metrics = Metrics(lambda: report)
    before = _scrape(metrics)
    assert before["peerd_bans_total"] == 0 and before["peerd_failed_rounds_total"] == 0
    assert before["peerd_uplink_bytes_per_second"] == 0  # not measured yet
    report["uplink"] = {"bytes_per_s": 12.6e6, "measured": True, "peaks_bytes_per_s": [12_000_000]}
    for event in (
        {"event": "eval", "outer_round": 0, "eval_nats_per_byte": 5.5},
        {"event": "inner", "outer_round": 0, "loss": 4.25, "tokens_per_s": 1800.0},
        {"event": "outer_round", "outer_round": 1, "round_s": 3.0, "allreduce_s": 0.4, "group_size": 3,
         "eval_nats_per_byte": 3.5},
        {"event": "round_failed", "outer_round": 1, "reason": "timeout"},
        {"event": "paused"},
    ):
        metrics.observe(event)
    m = _scrape(metrics)
    assert m["peerd_outer_round"] == 1 and m["peerd_outer_rounds_total"] == 1
    assert m["peerd_outer_round_seconds_count"] == 1 and m["peerd_outer_round_seconds_sum"] == 3.0
    assert m["peerd_allreduce_seconds_sum"] == 0.4 and m['peerd_allreduce_seconds_bucket{le="0.5"}'] == 1
    assert m["peerd_loss"] == 4.25 and m["peerd_tokens_per_second"] == 1800 and m["peerd_eval_loss"] == 3.5
    assert m["peerd_group_size"] == 3 and m["peerd_failed_rounds_total"] == 1 and m["peerd_paused"] == 1
    assert m["peerd_bytes_sent_total"] == 1234 and m["peerd_bytes_received_total"] == 99
    assert m['peerd_achieved_bytes_per_second{direction="upload"}'] == 2e6
    assert m['peerd_bandwidth_limit_bytes_per_second{direction="download"}'] == 0
    assert m["peerd_uplink_bytes_per_second"] == 12.6e6


def test_metrics_endpoint_on_loopback():
    metrics = Metrics()
    port = metrics.serve("127.0.0.1", 0)
    try:
        assert port > 0
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "peerd_outer_round_seconds_bucket" in body and "peerd_peers_seen" in body
    finally:
        metrics.close()


# --------------------------------------------------------------------------------------------------------- limits


class FakeTorch:
    def __init__(self):
        self.calls = []
        self.cuda = types.SimpleNamespace(
            current_device=lambda: 0,
            set_per_process_memory_fraction=lambda f, i: self.calls.append(("fraction", f, i)),
            get_device_properties=lambda i: types.SimpleNamespace(total_memory=24e9),
        )

    def device(self, d):
        import torch

        return torch.device(d)

    def set_num_threads(self, n):
        self.calls.append(("threads", n))

    def set_num_interop_threads(self, n):
        raise RuntimeError("already started")  # tolerated: only possible before inter-op work


def test_gpu_memory_fraction_is_applied_on_cuda_only():
    fake = FakeTorch()
    assert apply_gpu_memory_fraction(0.5, "cuda:1", torch_module=fake) is True
    assert apply_gpu_memory_fraction(0.75, "cuda", torch_module=fake) is True
    assert apply_gpu_memory_fraction(0.5, "cpu", torch_module=fake) is False
    assert apply_gpu_memory_fraction(0.0, "cuda", torch_module=fake) is False
    assert fake.calls == [("fraction", 0.5, 1), ("fraction", 0.75, 0)]
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        apply_gpu_memory_fraction(1.5, "cuda", torch_module=fake)


def test_cpu_threads():
    fake = FakeTorch()
    apply_cpu_threads(0, torch_module=fake)
    apply_cpu_threads(3, torch_module=fake)
    assert fake.calls == [("threads", 3)]


@pytest.mark.parametrize("changes, needle", [
    ({"gpu_memory_fraction": 1.5}, "gpu_memory_fraction"),
    ({"gpu_memory_fraction": -0.1}, "gpu_memory_fraction"),
    ({"upload_limit_mb_s": -1.0}, "upload_limit_mb_s"),
    ({"download_limit_mb_s": float("inf")}, "download_limit_mb_s"),
    ({"uplink_mb_s": -12.5}, "uplink_mb_s"),
    ({"active_hours": "25:00-07:00"}, "active_hours"),
    ({"metrics_port": 70000}, "metrics_port"),
    ({"health_max_age_s": 0.0}, "health_max_age_s"),
    ({"control_socket": "/tmp/" + "x" * 120}, "control_socket"),
])
def test_volunteer_fields_are_validated(changes, needle):
    with pytest.raises(ConfigError, match=needle):
        NodeConfig(**changes)


def test_volunteer_fields_from_file_and_env(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[node]\nupload_limit_mb_s = 5\nactive_hours = "22:00-07:00"\nmetrics_port = 9400\n')
    node = load_node_config(str(path), environ={"PEERD_DOWNLOAD_LIMIT_MB_S": "2.5", "PEERD_METRICS_PORT": "none",
                                                "PEERD_GPU_MEMORY_FRACTION": "0.5"})
    assert node.upload_limit_mb_s == 5.0 and node.download_limit_mb_s == 2.5 and node.gpu_memory_fraction == 0.5
    assert node.active_hours == "22:00-07:00" and node.metrics_port is None  # env "none" clears the file's port
    bad = tmp_path / "bad.toml"
    bad.write_text('[node]\nmetrics_port = "9400"\n')
    with pytest.raises(ConfigError, match=f"{bad}.*metrics_port"):
        load_node_config(str(bad), environ={})
    with pytest.raises(ConfigError, match="PEERD_METRICS_PORT"):
        load_node_config(None, environ={"PEERD_METRICS_PORT": "many"})
