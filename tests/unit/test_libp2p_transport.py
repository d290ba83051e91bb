"""The py-libp2p transport's pure parts: backend choice, the node config key, the identity it derives."""

from pathlib import Path

import pytest

from peerd.config import ConfigError, NodeConfig
from peerd.transport import libp2p_backend
from peerd.transport.libp2p_backend import READY_LINE, choose_backend

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def libp2p_installed(monkeypatch):
    """The choice as on a machine with py-libp2p installed, whether or not this one has it."""
    monkeypatch.setattr(libp2p_backend, "libp2p_available", lambda: None)


def test_auto_picks_libp2p_where_p2pd_cannot_run_and_says_why(monkeypatch, tmp_path, libp2p_installed):
    monkeypatch.setenv("PEERD_P2PD_BINARY", str(tmp_path / "missing" / "p2pd"))
    backend, why = choose_backend("auto")
    assert backend == "libp2p"
    assert str(tmp_path / "missing" / "p2pd") in why and "py-libp2p" in why


def test_auto_picks_p2pd_where_it_runs_and_explicit_choices_stand(monkeypatch, tmp_path, libp2p_installed):
    monkeypatch.delenv("PEERD_P2PD_BINARY", raising=False)
    assert choose_backend("auto")[0] == "p2pd"  # hivemind's bundled binary, built for this (linux x86_64) machine
    script = tmp_path / "p2pd"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    monkeypatch.setenv("PEERD_P2PD_BINARY", str(script))
    backend, why = choose_backend("auto")
    assert backend == "libp2p" and "is not an executable for Linux/" in why
    monkeypatch.setenv("PEERD_P2PD_BINARY", str(tmp_path / "absent"))
    assert choose_backend("p2pd")[0] == "p2pd"
    assert choose_backend("libp2p")[0] == "libp2p"


def test_auto_without_any_backend_is_a_connection_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PEERD_P2PD_BINARY", str(tmp_path / "absent"))
    monkeypatch.setattr(libp2p_backend, "libp2p_available", lambda: "python package 'libp2p' is not installed")
    with pytest.raises(ConnectionError, match="absent.*libp2p"):
        choose_backend("auto")


def test_node_config_transport_key():
    assert NodeConfig().transport == "auto"
    assert NodeConfig(transport="libp2p").transport == "libp2p"
    with pytest.raises(ConfigError, match="transport must be one of p2pd, libp2p, auto"):
        NodeConfig(transport="go")


def test_the_daemon_and_its_parent_agree_on_the_ready_line():
    """Read from the source: the daemon module cannot be imported beside hivemind. (That it derives the same
    PeerID from an identity file as p2pd is checked by the pure py-libp2p swarm test, through `peerd status`.)"""
    source = (ROOT / "peerd" / "transport" / "libp2p_daemon.py").read_text()
    assert f'READY_LINE = "{READY_LINE}"' in source
