"""The dashboard's server in-process, on a fake run and a fake local daemon: API values, actions through the
control handler, and who may use it (Host check, action header, token), plus the CLI's refusal to bind beyond
loopback without a token."""

import asyncio

import aiohttp
import pytest

from peerd.commands.main import main
from peerd.config import ConfigError, NodeConfig
from peerd.dashboard import security
from peerd.dashboard.app import Dashboard
from peerd.dashboard.view import history_view, loss_unit, peer_state, peers_view, run_view, stage_map

pytestmark = pytest.mark.timeout(30)

NOW = 1_800_000_000.0
PEERS = {
    "12D3KooWA": {"role": "diloco", "outer_round": 4, "inner_step": 3, "loss": 3.1, "tokens_per_s": 1000.0,
                  "eval_nats_per_byte": 3.2, "digest": "ab", "instance": "i1", "stage": None, "time": NOW - 1, "v": 1,
                  "history": {"loss": [[NOW - 30, 100, 4.0, 900.0], [NOW - 10, 200, 3.5, 1000.0]],
                              "eval": [[NOW - 20, 150, 3.4]]}},
    "12D3KooWB": {"role": "paused", "outer_round": 3, "inner_step": 0, "loss": 3.3, "tokens_per_s": 800.0,
                  "eval_nats_per_byte": 3.3, "digest": "cd", "instance": "i2", "stage": None, "time": NOW - 2, "v": 1,
                  "history": None},
    "12D3KooWC": {"role": "left", "outer_round": 2, "inner_step": 0, "loss": None, "tokens_per_s": None,
                  "eval_nats_per_byte": None, "digest": None, "instance": "i3", "stage": None, "time": NOW - 3,
                  "v": 1, "history": None},
}
CONFIG = {"config": {"model": "tiny", "parallelism": "diloco", "averaging": {"method": "allreduce"}},
          "fingerprint": "f00d", "creator": "12D3KooWA", "creators": ["12D3KooWA"]}


def test_views_of_the_run():
    rows = peers_view(PEERS, NOW, ttl_s=6.0)
    assert [r["peer"] for r in rows] == ["12D3KooWA", "12D3KooWB"]  # left peers are gone, most advanced first
    assert [r["state"] for r in rows] == ["online", "paused"] and "history" not in rows[0]
    assert rows[0]["last_seen_s"] == 1.0
    view = run_view("r", PEERS, CONFIG, NOW, ttl_s=6.0)
    assert view["live_peers"] == 2 and view["training_peers"] == 1 and view["outer_round"] == 4
    assert view["tokens_per_s"] == 1000.0 and view["best_eval_nats_per_byte"] == 3.2
    assert view["config"]["fingerprint"] == "f00d" and view["stages"] is None
    assert view["groups"] == {"diloco": ["12D3KooWA"]}  # training peers by role (a paused peer is in none)
    spes = run_view("r", {p: {**PEERS[p], "role": "spes"} for p in ("12D3KooWA", "12D3KooWB")}, CONFIG, NOW, ttl_s=6.0)
    assert spes["groups"] == {"spes": ["12D3KooWA", "12D3KooWB"]}
    assert view["loss_unit"] == "byte" and loss_unit(None) == "byte"  # a BPE run's losses are per token
    assert loss_unit({"config": {"tokenizer": "bpe:gpt2"}}) == "token"
    assert peer_state({"role": "diloco", "time": NOW - 5}, NOW, 6.0) == "stale"
    assert peer_state({"role": "diloco", "time": NOW - 4}, NOW, 6.0) == "online"
    assert peer_state({"role": "syncing", "time": NOW}, NOW, 6.0) == "joining"
    # history from the record where it has one; else what the dashboard sampled itself
    hist = history_view(PEERS, {"12D3KooWB": [[NOW - 5, None, 3.3, 800.0, None], [NOW - 4, None, 3.2, 810.0, 3.3]]},
                        [[NOW, 1800.0, 2]])
    assert hist["peers"]["12D3KooWA"] == PEERS["12D3KooWA"]["history"]
    assert hist["peers"]["12D3KooWB"] == {"loss": [[NOW - 5, None, 3.3, 800.0], [NOW - 4, None, 3.2, 810.0]],
                                          "eval": [[NOW - 4, None, 3.3]]}
    assert hist["run"] == [[NOW, 1800.0, 2]]


def test_stage_map_names_the_bottleneck():
    rows = [{"peer": "a", "stage": 0, "state": "online", "tokens_per_s": 50.0},
            {"peer": "b", "stage": 1, "state": "online", "tokens_per_s": 20.0},
            {"peer": "c", "stage": 1, "state": "online", "tokens_per_s": 20.0}]
    assert stage_map(rows, 2) == {"stages": [{"stage": 0, "servers": ["a"], "tokens_per_s": 50.0},
                                             {"stage": 1, "servers": ["b", "c"], "tokens_per_s": 40.0}],
                                  "bottleneck": 1}
    assert stage_map(rows, 3)["bottleneck"] == 2  # an empty stage first


class FakeNode:
    def __init__(self):
        self.requests = []
        self.paused = False

    async def __call__(self, request):
        self.requests.append(request)
        cmd = request["cmd"]
        if cmd in ("pause", "resume"):
            self.paused = cmd == "pause"
        if cmd == "set_rules" and "bogus" in request["rules"]:
            return {"ok": False, "error": "unknown rule 'bogus'"}
        return {"ok": True, "paused": self.paused, "healthy": True, "message": "fine"}


async def _serve(token=None, host="127.0.0.1", node=None):
    async def read_run():
        return PEERS, CONFIG

    dash = Dashboard("r", read_run, node, token=token, ttl_s=6.0, poll_s=0.05, clock=lambda: NOW)
    port = await dash.start(host, 0)
    await asyncio.wait_for(dash._refreshed.wait(), 5)
    return dash, f"http://127.0.0.1:{port}"


def test_api_serves_the_run_and_acts_on_the_node():
    async def main_():
        node = FakeNode()
        dash, base = await _serve(node=node)
        try:
            async with aiohttp.ClientSession() as http:
                async def get(path, **kw):
                    async with http.get(base + path, **kw) as r:
                        return r.status, await r.json()

                async def post(path, body=None, headers=None):
                    async with http.post(base + path, json=body or {}, headers=headers) as r:
                        return r.status, await r.json()

                status, run = await get("/api/run")
                assert status == 200 and run["live_peers"] == 2 and run["has_node"] and run["read_at"] == NOW
                status, peers = await get("/api/peers")
                assert [p["peer"] for p in peers["peers"]] == ["12D3KooWA", "12D3KooWB"]
                assert peers["peers"][0]["loss"] == 3.1
                status, hist = await get("/api/history")
                assert hist["peers"]["12D3KooWA"]["eval"] == [[NOW - 20, 150, 3.4]]
                from peerd.events import Banned, RoundFailed

                dash.observe(Banned("12D3KooWX", "wrong part size", 60.0))
                dash.observe(RoundFailed(4, "group too small", "allreduce"))
                status, node_view = await get("/api/node")
                assert node_view["available"] and node_view["health"]["healthy"]
                assert node_view["bans"] == [{"time": NOW, "peer": "12D3KooWX", "reason": "wrong part size"}]
                assert node_view["rounds"] == [{"time": NOW, "outer_round": 4, "ok": False,
                                                "reason": "group too small"}]
                # an action without the header (what a cross-site form sends) does nothing
                assert (await post("/api/node/pause"))[0] == 403 and not node.paused
                act = {security.ACTION_HEADER: "1"}
                status, reply = await post("/api/node/pause", headers=act)
                assert status == 200 and reply["paused"] and node.paused
                assert (await post("/api/node/pause_after_round", headers=act))[0] == 200
                assert (await post("/api/node/reboot", headers=act))[0] == 404
                status, reply = await post("/api/node/rules", {"pause_on_battery": True}, headers=act)
                assert status == 200 and node.requests[-1] == {"cmd": "set_rules", "rules": {"pause_on_battery": True}}
                assert (await post("/api/node/rules", {"bogus": 1}, headers=act))[0] == 400
                # a page on another site that resolves its name to 127.0.0.1 (DNS rebinding) is refused
                assert (await get("/api/run", headers={"Host": "evil.example:80"}))[0] == 403
                async with http.get(base + "/") as r:
                    page = await r.text()
                assert r.status == 200 and 'id="peers"' in page and "/static/plotly.min.js" in page
                assert "http://" not in page and "https://" not in page  # nothing from the internet
                async with http.get(base + "/static/plotly.min.js") as r:
                    assert r.status == 200 and len(await r.read()) > 100_000
        finally:
            await dash.stop()
        assert [r["cmd"] for r in node.requests if r["cmd"] not in ("status", "health")] == [
            "pause", "pause_after_round", "set_rules", "set_rules"]

    asyncio.run(main_())


def test_token_guards_a_dashboard_beyond_loopback():
    async def main_():
        with pytest.raises(ValueError, match="dashboard_token"):
            await Dashboard("r", None).start("0.0.0.0", 0)
        token = "s3cret-s3cret-s3cret"
        dash, base = await _serve(token=token, host="0.0.0.0")
        try:
            # unsafe: keep cookies of an IP address, as browsers do
            async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
                async with http.get(base + "/api/run") as r:
                    assert r.status == 401
                async with http.get(base + "/api/run?token=wrong-wrong-wrong-wrong") as r:
                    assert r.status == 401
                async with http.get(base + f"/?token={token}") as r:
                    assert r.status == 200 and security.COOKIE in r.cookies
                async with http.get(base + "/api/run") as r:  # the cookie from the first visit
                    assert r.status == 200
                async with aiohttp.ClientSession() as other:
                    async with other.get(base + "/api/run", headers={"Authorization": f"Bearer {token}"}) as r:
                        assert r.status == 200
        finally:
            await dash.stop()

    asyncio.run(main_())


def test_binding_beyond_loopback_needs_a_token(capsys, tmp_path):
    assert security.bind_problem("127.0.0.1", None) is None and security.bind_problem("::1", None) is None
    assert security.bind_problem("localhost", None) is None
    assert "dashboard_token" in security.bind_problem("0.0.0.0", None)
    assert "16" in security.bind_problem("0.0.0.0", "short")
    with pytest.raises(ConfigError, match="dashboard_token"):
        NodeConfig(dashboard_host="192.0.2.1", checkpoint_dir=str(tmp_path))
    peer = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"
    for argv in (["dashboard", "--run-id", "r", "--initial-peers", peer, "--dashboard-host", "0.0.0.0"],
                 ["join", "--run-id", "r", "--dashboard-port", "0", "--dashboard-host", "0.0.0.0",
                  "--checkpoint-dir", str(tmp_path)]):
        assert main(argv) == 2
        lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("peerd")]  # not torch's warnings
        assert len(lines) == 1 and "--dashboard-host" in lines[0] and "dashboard_token" in lines[0]
