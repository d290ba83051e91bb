"""The volunteer commands without a daemon: help, one-line errors, install-service, config provenance, env run id."""

import json
import logging
import os
import subprocess
from types import SimpleNamespace

import pytest

from peerd.commands.main import main
from peerd.commands.parser import build_parser
from peerd.testing.localswarm import LOCAL, peerd_cmd

pytestmark = pytest.mark.timeout(120)


def _peerd(*args, env=None, timeout=60):
    return subprocess.run(peerd_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def peerd(capsys, monkeypatch):
    """``peerd(*args, env={}) -> (exit code, stdout, stderr)``: the CLI's ``main`` in this process (no interpreter
    and torch start per call); the root logger it reconfigures is restored."""
    root = logging.getLogger()

    def run(*args, env=None):
        saved = root.handlers[:], root.level
        with monkeypatch.context() as m:
            for key, value in (env or {}).items():
                m.setenv(key, value)
            try:
                code = main(list(args))
            finally:
                root.handlers[:], root.level = saved
                logging.captureWarnings(False)
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


@pytest.mark.parametrize("command", ["pause", "resume", "health", "install-service"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: peerd {command}" in out and "--help" in out and len(out.splitlines()) > 5


@pytest.mark.parametrize("command", ["pause", "health"])
def test_no_daemon_is_a_runtime_failure_in_one_line(tmp_path, command, peerd):
    # the real entry point for one of them, the in-process main for the other
    result = _peerd(command, "--checkpoint-dir", str(tmp_path)) if command == "health" else \
        peerd(command, "--checkpoint-dir", str(tmp_path))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no peerd daemon running" in lines[0] and str(tmp_path) in lines[0], result.stderr


def test_usage_errors_exit_2(peerd):
    assert peerd("health", "--max-age-s", "-1").returncode == 2
    bad = peerd("join", "--run-id", "x", "--upload-limit", "-3", "--config", str(LOCAL))
    assert bad.returncode == 2 and "upload_limit_mb_s" in bad.stderr
    hours = peerd("config", "show", "--active-hours", "7-22")
    assert hours.returncode == 2 and "active_hours" in hours.stderr and len(hours.stderr.strip().splitlines()) == 1


BOOTSTRAP = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWKbVaxDqFciM1PngLgGXCskoJKt22WxpPdZ7JMvqUPyVe"


def test_install_service_writes_the_unit_and_prints_the_commands(tmp_path, peerd):
    config = tmp_path / "node.toml"
    config.write_text('[node]\nupload_limit_mb_s = 5\n')
    result = peerd("install-service", "--run-id", "r1", "--config", str(config), "--unit-dir", str(tmp_path / "u"),
                    "--initial-peers", BOOTSTRAP, "--peerd", "/opt/p/bin/peerd")
    assert result.returncode == 0, result.stderr
    unit = (tmp_path / "u" / "peerd.service").read_text()
    assert (f"ExecStart=/opt/p/bin/peerd join --run-id r1 --config {config} "
            f"--initial-peers {BOOTSTRAP}") in unit
    assert "Type=notify" in unit and "WatchdogSec=120" in unit
    typo = peerd("install-service", "--run-id", "r1", "--print", "--peerd", "/opt/p/bin/peerd",
                 "--initial-peers", "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWA")
    assert typo.returncode == 2 and "--initial-peers" in typo.stderr and len(typo.stderr.strip().splitlines()) == 1
    # the config lives under /tmp here; under /home or /root the unit would need ProtectHome=read-only
    assert ("ProtectHome=read-only" in unit) == str(config).startswith(("/home/", "/root/"))
    for needle in ("systemctl daemon-reload", "systemctl enable --now peerd.service", "useradd --system"):
        assert needle in result.stdout
    printed = peerd("install-service", "--run-id", "r1", "--peerd", "/opt/p/bin/peerd", "--print")
    assert printed.returncode == 0 and printed.stdout.startswith("# peerd as a volunteer's service")
    refused = peerd("install-service", "--run-id", "r1", "--peerd", "/opt/p/bin/peerd",
                     "--unit-dir", "/proc/no-such-dir")
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    missing = peerd("install-service")
    assert missing.returncode == 2 and "--run-id" in missing.stderr


def test_config_show_says_where_each_value_came_from(peerd):
    result = peerd("config", "show", "--config", str(LOCAL), "--threads", "2", "--upload-limit", "3",
                   "--uplink", "12.5", "--micro-batch-size", "4", "--precision", "bf16", "--activation-checkpointing",
                   env={"PEERD_METRICS_PORT": "9400", "PEERD_THREADS": "7"})
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    node, sources = shown["node"], shown["sources"]
    assert set(sources) == set(node)
    assert (node["threads"], sources["threads"]) == (2, "flag --threads")  # flag > env > file
    assert (node["upload_limit_mb_s"], sources["upload_limit_mb_s"]) == (3.0, "flag --upload-limit")
    assert (node["uplink_mb_s"], sources["uplink_mb_s"]) == (12.5, "flag --uplink")
    assert (node["metrics_port"], sources["metrics_port"]) == (9400, "env PEERD_METRICS_PORT")
    assert (node["status_interval_s"], sources["status_interval_s"]) == (1.0, f"file {LOCAL}")
    assert (node["micro_batch_size"], sources["micro_batch_size"]) == (4, "flag --micro-batch-size")
    assert (node["precision"], node["activation_checkpointing"], node["compile"]) == ("bf16", True, False)
    assert sources["identity"] == "default"


def test_run_id_from_the_environment(peerd):
    """The container's contract: `docker run -e PEERD_RUN_ID=... peerd join`; a bad value is a usage error."""
    bad = peerd("join", "--config", str(LOCAL), env={"PEERD_RUN_ID": "bad id!"})
    assert bad.returncode == 2 and "invalid run id" in bad.stderr
    status = peerd("status", env={"PEERD_RUN_ID": "fine"})
    assert status.returncode == 2 and "--initial-peers" in status.stderr  # the run id was accepted from the env


def test_a_run_name_that_would_alias_dht_keys_is_a_usage_error(peerd):
    """'/' and '.' (the DHT key separator) in a run name, or a creator prefix too short to bind a key: exit 2 with
    one line, before anything starts."""
    for bad in ("bad/name", "a.b", "demo@12D3KooWshort", "demo@", "@12D3KooWAAAAAAAAAAAAAAAAAAAA"):
        result = peerd("join", "--run-id", bad, "--config", str(LOCAL))
        assert result.returncode == 2, (bad, result)
        assert "invalid run id" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
