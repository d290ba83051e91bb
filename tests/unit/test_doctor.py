"""`peerd doctor`'s lines and exit codes, the clock check, the `relay` key and the status record's `reachable`."""

import pytest

import peerd.commands.doctor as doctor
from peerd.commands.main import main
from peerd.config import ConfigError, NodeConfig
from peerd.identity.namespace import RunRef
from peerd.status.records import make_status, status_problem
from peerd.transport.dialback import listens_on_loopback_only
from peerd.transport.hivemind_backend import dht_start_error, relay_options

pytestmark = pytest.mark.timeout(60)

PEER = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def test_clock_check():
    assert doctor.clock_check([], 1000.0).ok
    assert doctor.clock_check([995.0, 1001.0], 1000.0).ok
    behind = doctor.clock_check([1060.0], 1000.0)
    assert not behind.ok and "60 s behind" in behind.detail and "NTP" in behind.line()
    assert not doctor.clock_check([100.0], 1000.0).ok


def test_check_lines():
    assert doctor.Check("p2pd", True, "fine", "never shown").line() == "OK    p2pd         fine"
    assert doctor.Check("reachable", False, "not reachable", "forward TCP port 4001").line() == \
        "FAIL  reachable    not reachable; fix: forward TCP port 4001"


def _doctor(monkeypatch, capsys, checks, *flags):
    async def network(node, run_id):
        assert node.initial_peers == (PEER,) and isinstance(run_id, RunRef) and str(run_id) == "demo"  # parsed once, by the CLI
        return checks

    monkeypatch.setattr(doctor, "network_checks", network)
    code = main(["doctor", "--run-id", "demo", "--initial-peers", PEER, *flags])
    return code, capsys.readouterr().out.splitlines()


def test_doctor_exit_codes(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(doctor, "check_p2pd", lambda: doctor.Check("p2pd", True, "runs"))
    monkeypatch.setattr(doctor, "check_libp2p", lambda: doctor.Check("py-libp2p", True, "importable"))
    ok = [doctor.Check("bootstrap", True, "joined"), doctor.Check("reachable", True, "reachable: at /ip4/...")]
    code, lines = _doctor(monkeypatch, capsys, ok, "--checkpoint-dir", str(tmp_path))
    assert code == 0
    assert [line.split()[1] for line in lines] == ["p2pd", "py-libp2p", "bootstrap", "reachable", "device"]
    assert all(line.startswith("OK") for line in lines)
    bad = ok[:1] + [doctor.Check("reachable", False, "not reachable", "forward TCP port 4001")]
    code, lines = _doctor(monkeypatch, capsys, bad, "--checkpoint-dir", str(tmp_path))
    assert code == 1
    assert "FAIL  reachable    not reachable; fix: forward TCP port 4001" in lines


def test_doctor_reports_a_crashing_check_as_one_line(monkeypatch, capsys, tmp_path):
    async def broken(node, run_id):
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor, "network_checks", broken)
    assert main(["doctor", "--run-id", "demo", "--initial-peers", PEER, "--checkpoint-dir", str(tmp_path)]) == 1
    assert any(line.startswith("FAIL  network") and "boom" in line for line in capsys.readouterr().out.splitlines())


def test_doctor_without_peers_and_bad_flags(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("PEERD_INITIAL_PEERS", raising=False)
    assert main(["doctor", "--run-id", "demo", "--checkpoint-dir", str(tmp_path)]) == 1
    assert "FAIL  bootstrap    no initial peers given; fix: pass --initial-peers" in capsys.readouterr().out
    assert main(["doctor", "--run-id", "demo", "--relay", "sometimes"]) == 2
    assert "sometimes" in capsys.readouterr().err
    monkeypatch.delenv("PEERD_RUN_ID", raising=False)
    assert main(["doctor", "--initial-peers", PEER]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) >= 1


def test_relay_key_and_options():
    assert NodeConfig().relay == "auto"
    with pytest.raises(ConfigError, match="relay must be one of off, auto, always"):
        NodeConfig(relay="sometimes")
    assert relay_options("off") == {"use_relay": False, "use_auto_relay": False}
    assert relay_options("auto") == {"use_relay": True, "use_auto_relay": True}
    assert relay_options("always") == {"use_relay": True, "use_auto_relay": True, "force_reachability": "private"}
    assert relay_options("always", client_mode=True) == {"use_relay": True, "use_auto_relay": False}
    boot = f"/ip4/192.0.2.1/tcp/31337/p2p/{PEER.rsplit('/', 1)[1]}"
    assert relay_options("auto", relays=[boot, boot, "/ip4/192.0.2.2/tcp/1"]) == {
        "use_relay": True, "use_auto_relay": True, "trusted_relays": [boot], "p2pd_flags": {"relayDiscovery": False}}
    assert relay_options("auto", client_mode=True, relays=[boot]) == {"use_relay": True, "use_auto_relay": False}
    assert relay_options("off", relays=[boot]) == {"use_relay": False, "use_auto_relay": False}


def test_p2pd_flags_reach_the_command_line_of_the_dht_process_p2pd(monkeypatch):
    import hivemind.dht.node as dht_node

    from peerd.transport.hivemind_dht import _add_p2pd_flags

    monkeypatch.setattr(dht_node, "P2P", dht_node.P2P)  # restored after the test
    plain = dht_node.P2P._make_process_args("p2pd", autoRelay=True, trustedRelays="/ip4/192.0.2.1/tcp/1/p2p/x")
    _add_p2pd_flags({"relayDiscovery": False})
    args = dht_node.P2P._make_process_args("p2pd", autoRelay=True, trustedRelays="/ip4/192.0.2.1/tcp/1/p2p/x")
    assert args == plain + ["-relayDiscovery=0"]


def test_status_record_carries_reachable():
    assert status_problem(make_status(role="diloco", reachable=False)) is None
    assert status_problem(make_status(role="diloco", reachable=None)) is None
    assert "reachable" in status_problem(make_status(role="diloco", reachable="yes"))
    assert status_problem(make_status(role="diloco", reachable=False, relayed=True)) is None
    assert "relayed" in status_problem(make_status(role="diloco", reachable=False, relayed="yes"))


def test_loopback_only():
    assert listens_on_loopback_only(["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"])
    assert not listens_on_loopback_only(["/ip4/0.0.0.0/tcp/0"])
    assert not listens_on_loopback_only(["/ip4/127.0.0.1/tcp/0", "/ip4/192.168.1.2/tcp/0"])
    assert not listens_on_loopback_only([])


def test_status_table_has_a_reachable_column(monkeypatch, capsys):
    import peerd.daemon

    peers = {"12D3KooWA": make_status(role="diloco", outer_round=2, reachable=True),
             "12D3KooWB": make_status(role="diloco", outer_round=1, reachable=False),
             "12D3KooWC": make_status(role="diloco", outer_round=0)}

    async def read_status(node, run_id):
        return peers, None

    monkeypatch.setattr(peerd.daemon, "read_status", read_status)
    assert main(["status", "--run-id", "demo", "--initial-peers", PEER]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-1] == "reachable"
    cells = {line.split()[0]: line for line in lines[2:]}
    assert cells["12D3KooWA"].endswith(" yes") and cells["12D3KooWB"].endswith(" no")
    assert cells["12D3KooWC"].endswith(" -")


def test_a_dht_that_reached_no_initial_peer_says_what_to_check():
    peer = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWBtPz6XL3brK5mWeGxqXyUL4BxTNkRTntktMeg3eCo6LZ"
    p2pd = dht_start_error(RuntimeError("Daemon failed to start: failed to connect to bootstrap peers"), [peer])
    assert isinstance(p2pd, ConnectionError)
    assert str(p2pd).startswith("could not start the DHT node: Daemon failed to start")
    assert "none of the 1 initial peer(s) answered" in str(p2pd) and peer in str(p2pd)
    assert "initial peer" in str(dht_start_error(TimeoutError("none answered within 30 s"), [peer]))
    other = dht_start_error(OSError("address already in use"), [peer])  # not the initial peers' fault: no hint
    assert str(other) == "could not start the DHT node: address already in use"
    assert "initial peer" not in str(dht_start_error(TimeoutError("slow"), []))


def test_a_relayed_peer_passes_the_reachable_check_with_the_way_to_direct_connections():
    from peerd.commands.doctor import reachability_check
    from protocols.reachability import Verdict

    relay = f"/ip4/192.0.2.1/tcp/31337/p2p/{PEER.rsplit('/', 1)[1]}"
    relayed = reachability_check(Verdict(False, public_ip="81.2.69.160", ports=[4001], relays=[relay]))
    assert relayed.ok and relayed.line().startswith(f"OK    reachable    not directly reachable; reachable through "
                                                    f"relay {relay} (slower")
    assert "forward TCP port 4001" in relayed.line()
    alone = reachability_check(Verdict(False, public_ip="81.2.69.160", ports=[4001]))
    assert not alone.ok and alone.detail == "not reachable: no peer could dial this peer back"
    assert alone.fix.startswith("forward TCP port 4001")
