"""The command line: help, usage errors, run-config conflicts, status of a live run."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from peerd.commands.main import main
from peerd.testing.localswarm import LOCAL, TINY, Swarm, peerd_cmd

pytestmark = pytest.mark.timeout(180)


def _peerd(*args, timeout=240):  # a safety net: a join that is refused exits in seconds on a quiet machine
    return subprocess.run(peerd_cmd(*args), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [[], ["join"], ["bootstrap"], ["status"], ["config", "show"]])
def test_help_exits_zero_and_describes_the_command(command):
    result = _peerd(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: peerd" in result.stdout and "--help" in result.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["join"], "--run-id"),
        (["join", "--run-id", "x", "--no-such-flag"], "--no-such-flag"),
        (["join", "--run-id", "bad id!"], "invalid run id"),
        (["join", "--run-id", "x", "--device", "tpu"], "--device"),
        (["join", "--run-id", "x", "--role", "boss"], "--role"),
        (["join", "--run-id", "x", "--dht", "remote"], "--dht"),
        (["join", "--run-id", "x", "--stage", "-1"], "stage"),
        (["join", "--run-id", "x", "--stage", "2", "--run-config", "node_configs/runs/swarm-tiny.toml"],
         "--stage 2"),
        (["join", "--run-id", "x", "--stage", "0", "--run-config", "node_configs/runs/tiny-test.toml"],
         "--stage 0"),
        (["join", "--run-id", "x", "--precision", "fp8"], "--precision"),
        (["join", "--run-id", "x", "--micro-batch-size", "-1"], "micro_batch_size"),
        # checked against the run config before the DHT: no run is published, no log line comes first
        (["join", "--run-id", "x", "--run-config", "node_configs/runs/tiny-test.toml", "--micro-batch-size", "3"],
         "must divide the run's batch_size (8): use one of 1, 2, 4, 8"),
        (["join", "--run-id", "x", "--config", "node_configs/runs/tiny-test.toml"],
         "pass it as --run-config node_configs/runs/tiny-test.toml"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_usage_errors_exit_2_with_one_clear_line(args, needle):
    result = _peerd(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
    # one format for every usage error: `peerd COMMAND: what is wrong` (runtime errors are log lines)
    assert re.match(r"peerd( [a-z-]+)?: ", lines[0]) and "error:" not in lines[0], lines[0]


@pytest.mark.timeout(60)
def test_python_dash_m_peerd_is_the_peerd_command():
    """``python -m peerd`` (a virtualenv whose scripts are not on PATH) runs the same command line."""
    ok = subprocess.run([sys.executable, "-m", "peerd", "join", "--help"], capture_output=True, text=True, timeout=50)
    assert ok.returncode == 0, ok.stderr
    assert "usage: peerd join" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "peerd", "join", "--no-such-flag"], capture_output=True, text=True,
                         timeout=50)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["peerd: unrecognized arguments: --no-such-flag (see `peerd --help`)"]


def test_bad_config_file_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[node]\ndevise = 'cpu'\n")
    result = _peerd("config", "show", "--config", str(bad))
    assert result.returncode == 2
    assert "devise" in result.stderr and str(bad) in result.stderr


def test_a_swarm_run_config_with_an_outer_step_exits_2_in_one_line(tmp_path, capsys):
    path = tmp_path / "swarm.toml"
    path.write_text('parallelism = "swarm"\nmodel = "tiny"\n[diloco]\nouter_momentum = 0.9\n')
    assert main(["config", "show", "--run-config", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "outer_momentum" in lines[0] and str(path) in lines[0], lines


def test_config_show_prints_the_effective_config():
    result = _peerd("config", "show", "--config", str(LOCAL), "--run-config", str(TINY), "--threads", "2")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["node"]["threads"] == 2  # the flag beats the file's 1
    assert shown["node"]["host_maddrs"] == ["/ip4/127.0.0.1/tcp/0"]
    assert shown["run"]["model"] == "tiny"


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(600)  # a training peer, then two fresh interpreters: ~40 s quiet, 180+ s beside a CPU hog
def test_status_conflicting_config_and_missing_config(tmp_path, capsys):
    # the two status reads run the command line in-process: a fresh process spends most of its time importing torch
    # and hivemind (CPU-bound next to the training peer), and what is checked here is the command's output; the
    # joins stay processes (a daemon sets process-wide state: threads, signal handlers, the identity lock)
    swarm = Swarm(tmp_path)
    try:
        maddr = swarm.start_bootstrap()
        endless = tmp_path / "endless.toml"
        endless.write_text(TINY.read_text().replace("max_outer_rounds = 2", "max_outer_rounds = 0"))
        peer = swarm.start_peer("p0", "cli-run", endless)
        swarm.wait_for(lambda: bool(peer.of("eval")), 90, "the peer to start training")

        capsys.readouterr()
        code = main(["status", "--run-id", "cli-run", "--initial-peers", maddr, "--json"])
        status = capsys.readouterr()
        assert code == 0, status.err
        peers = json.loads(status.out)["peers"]
        assert len(peers) == 1 and next(iter(peers.values()))["role"] == "diloco"
        code = main(["status", "--run-id", "cli-run", "--initial-peers", maddr])
        table = capsys.readouterr()
        assert code == 0 and "1 live peer" in table.out and "diloco" in table.out, table
        # the run's config record outlives its creator (CONFIG_TTL_S): the joins below need no peer training beside
        # them, only the DHT
        peer.proc.send_signal(signal.SIGINT)
        assert swarm.wait_exit(peer, 60) == 0
        assert peer.of("leave")

        conflicting = tmp_path / "other.toml"
        conflicting.write_text(endless.read_text().replace('model = "tiny"', 'model = "small"'))
        refused = _peerd("join", "--run-id", "cli-run", "--run-config", str(conflicting), "--config", str(LOCAL),
                         "--initial-peers", maddr, "--identity", str(tmp_path / "x.key"),
                         "--checkpoint-dir", str(tmp_path / "x"))
        assert refused.returncode == 1
        assert "disagrees" in refused.stderr and "model" in refused.stderr

        missing = subprocess.run(peerd_cmd("join", "--run-id", "no-such-run", "--config", str(LOCAL), "--initial-peers",
                                           maddr, "--identity", str(tmp_path / "y.key"), "--checkpoint-dir",
                                           str(tmp_path / "y")), capture_output=True, text=True, timeout=240,
                                 env={**os.environ, "PEERD_CONFIG_WAIT_S": "3"})
        assert missing.returncode == 1
        assert "no configuration published yet: waiting up to 3 s" in missing.stderr, missing.stderr
        assert "still has no configuration published in the DHT after 3 s" in missing.stderr, missing.stderr

    finally:
        swarm.close()


def test_bootstrap_keeps_its_peer_id_across_restarts(tmp_path):
    ids, codes = [], []
    for _ in range(2):
        swarm = Swarm(tmp_path)
        try:
            ids.append(swarm.start_bootstrap().rsplit("/p2p/", 1)[1])
            swarm._bootstrap.send_signal(signal.SIGTERM)
            codes.append(swarm._bootstrap.wait(60))
        finally:
            swarm.close()
    assert ids[0] == ids[1] and ids[0].startswith("12D3KooW")
    assert oct((tmp_path / "bootstrap.key").stat().st_mode & 0o777) == "0o600"
    # stopped by SIGTERM: it says what it does, and a bootstrap node has nothing to checkpoint
    log = (tmp_path / "bootstrap.err").read_text()
    assert codes == [0, 0] and "received SIGTERM: leaving the DHT" in log and "checkpoint" not in log, log


def test_light_commands_do_not_import_torch():
    """`peerd --help`, `health`, `pause`, `config show` stay fast: the CLI and the node config import no torch."""
    probe = ("import sys, peerd.commands.main, peerd.config, peerd.service.control; "
             "print(sorted(m for m in ('torch', 'hivemind', 'protocols.allreduce') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("how, needle", [
    ("flag", "--initial-peers"), ("file", "initial_peers"), ("env", "PEERD_INITIAL_PEERS"),
])
def test_a_malformed_multiaddr_is_a_usage_error_naming_the_flag_key_or_variable(tmp_path, how, needle):
    """Caught in the node config, before any process starts (was: p2pd failing to parse it, exit 1)."""
    args, env = ["join", "--run-id", "x", "--checkpoint-dir", str(tmp_path / "ckpt")], dict(os.environ)
    if how == "flag":
        args += ["--initial-peers", "notamaddr"]
    elif how == "file":
        (tmp_path / "node.toml").write_text('[node]\ninitial_peers = ["notamaddr"]\n')
        args += ["--config", str(tmp_path / "node.toml")]
    else:
        env["PEERD_INITIAL_PEERS"] = "notamaddr"
    result = subprocess.run(peerd_cmd(*args), capture_output=True, text=True, timeout=90, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "notamaddr" in lines[0], result.stderr
    assert not (tmp_path / "ckpt").exists()  # nothing started


def test_an_initial_peer_without_a_peer_id_is_a_usage_error():
    result = _peerd("join", "--run-id", "x", "--initial-peers", "/ip4/127.0.0.1/tcp/31337")
    assert result.returncode == 2 and "/p2p/<PeerID>" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
