"""The control socket (0600, one daemon per socket, stale sockets replaced) and the health verdict."""

import asyncio
import json
import socket
import stat

import pytest

from peerd.service.control import ControlServer, ControlUnavailable, request
from peerd.service.health import DaemonState, assess_health

pytestmark = pytest.mark.timeout(30)


async def _echo(req):
    return {"ok": True, "echo": req}


def _in_thread(fn, *args):
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


def test_round_trip_permissions_and_cleanup(tmp_path):
    path = tmp_path / "state" / "peerd.sock"

    async def main():
        server = ControlServer(path, _echo)
        assert await server.start()
        mode = path.stat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        reply = await _in_thread(request, path, {"cmd": "status", "x": 1})
        assert reply == {"ok": True, "echo": {"cmd": "status", "x": 1}}
        await server.close()
        assert not path.exists()

    asyncio.run(main())


def test_second_daemon_is_refused_and_a_stale_socket_is_replaced(tmp_path):
    path = tmp_path / "peerd.sock"
    # a socket file left by a daemon that was killed: nobody listens
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    with pytest.raises(ControlUnavailable, match="stale control socket"):
        request(path, {"cmd": "status"})

    async def main():
        first = ControlServer(path, _echo)
        assert await first.start()  # replaced the stale file
        second = ControlServer(path, _echo)
        assert await second.start() is False  # the first holds the lock: it keeps its socket
        assert (await _in_thread(request, path, {"cmd": "status"}))["ok"]
        await second.close()
        assert path.exists()  # closing the refused one did not remove the first one's socket
        await first.close()

    asyncio.run(main())


def test_bad_requests_get_an_error_reply(tmp_path):
    path = tmp_path / "peerd.sock"

    async def boom(req):
        raise RuntimeError("handler bug")

    def raw(line: bytes) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(path))
            s.sendall(line)
            return json.loads(s.makefile().readline())

    async def main():
        server = ControlServer(path, boom)
        await server.start()
        try:
            not_json = await _in_thread(raw, b"hello\n")
            no_cmd = await _in_thread(raw, b'{"x": 1}\n')
            failing = await _in_thread(raw, b'{"cmd": "status"}\n')
        finally:
            await server.close()
        return not_json, no_cmd, failing

    not_json, no_cmd, failing = asyncio.run(main())
    assert not not_json["ok"] and "bad request" in not_json["error"]
    assert not no_cmd["ok"] and "cmd" in no_cmd["error"]
    assert not failing["ok"] and "handler bug" in failing["error"]


def test_client_errors_are_one_clear_line(tmp_path):
    with pytest.raises(ControlUnavailable, match="no peerd daemon running .*no control socket"):
        request(tmp_path / "missing.sock", {"cmd": "health"})


# ----------------------------------------------------------------------------------------------------------- health


def _worker(**kw) -> DaemonState:
    return DaemonState(role="diloco", run_id="r", started_at=1000.0, **kw)


def test_health_of_a_worker():
    state = _worker()
    ok, line = assess_health(state, {}, now=1010.0, max_age_s=60)
    assert not ok and "not joined yet" in line and "10 s" in line

    state.observe({"event": "eval", "outer_round": 0}, now=1020.0)  # trained, evaluated: joined
    ok, line = assess_health(state, {}, now=1030.0, max_age_s=60)
    assert ok and "joined 10 s ago" in line

    state.observe({"event": "outer_round", "outer_round": 1, "eval_nats_per_byte": 3.5}, now=1050.0)
    ok, line = assess_health(state, {}, now=1100.0, max_age_s=60)
    assert ok and "outer round 1 completed 50 s ago" in line
    assert state.last_eval_nats_per_byte == 3.5 and state.rounds_completed == 1

    state.observe({"event": "round_failed", "outer_round": 1}, now=1120.0)
    ok, line = assess_health(state, {}, now=1200.0, max_age_s=60)
    assert not ok and "no round completed or joined for 150 s" in line and "1 failed" in line

    state.observe({"event": "state_download", "outer_round": 4}, now=1210.0)  # caught up: joined again
    ok, line = assess_health(state, {}, now=1220.0, max_age_s=60)
    assert ok and "joined 10 s ago" in line and state.outer_round == 4


def test_health_when_paused_resumed_or_left():
    state = _worker()
    state.observe({"event": "eval", "outer_round": 0}, now=1000.0)
    state.observe({"event": "paused", "outer_round": 0}, now=1001.0)
    ok, line = assess_health(state, {"user": "paused by the volunteer"}, now=9000.0, max_age_s=60)
    assert ok and "paused (paused by the volunteer)" in line
    state.observe({"event": "resumed", "outer_round": 0}, now=9001.0)  # rejoining counts as joining
    ok, line = assess_health(state, {}, now=9010.0, max_age_s=60)
    assert ok and state.worker_state == "training"
    state.observe({"event": "leave", "outer_round": 0}, now=9020.0)
    ok, line = assess_health(state, {}, now=9021.0, max_age_s=60)
    assert not ok and "left" in line


def test_health_of_a_bootstrap_node():
    state = DaemonState(role="bootstrap", started_at=1000.0)
    assert assess_health(state, {}, now=1005.0, max_age_s=60)[0] is False
    state.joined_at = 1006.0
    ok, line = assess_health(state, {}, now=99999.0, max_age_s=60)
    assert ok and "bootstrap node up" in line
