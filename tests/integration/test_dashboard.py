"""The web dashboard on a real 3-peer run on 127.0.0.1 (one run shared by every test of this module, in order):

- in headless Chromium, the dashboard that peer A serves (`join --dashboard-port`) shows 3 peer rows and a loss
  plot with points; pressing "Pause now" shows the paused state; a screenshot is saved as a test artifact;
- `peerd dashboard` (a separate process reading the DHT) answers /api/run, /api/peers, /api/history and /api/node
  with the values `peerd status --json` prints, A's status record says `paused`.
"""

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from peerd.service import control
from peerd.testing.localswarm import TINY, Swarm, peerd_cmd

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dashboard"), pytest.mark.timeout(600)]  # one module swarm

RUN = "dash"
ARTIFACTS = Path(os.environ.get("PEERD_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))


def _get(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _dashboard_url(peer) -> str | None:
    found = peer.of("dashboard")
    return found[0]["url"] if found else None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    swarm = Swarm(tmp)
    try:
        swarm.start_bootstrap(timeout_s=90)  # generous: imports alone take tens of seconds on a loaded machine
        config = tmp / "endless.toml"
        config.write_text(TINY.read_text().replace("max_outer_rounds = 2", "max_outer_rounds = 0"))
        a = swarm.start_peer("a", RUN, config, "--dashboard-port", "0", "--device", "auto")
        b = swarm.start_peer("b", RUN, config)
        c = swarm.start_peer("c", RUN, config)
        # `peerd dashboard`, a separate process reading the DHT, starts while the peers warm up
        dash = swarm.start_process("dashboard", peerd_cmd(
            "dashboard", "--run-id", RUN, "--initial-peers", swarm.bootstrap_maddr, "--dashboard-port", "0",
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(tmp / "ckpt-a"), "--log-format", "json"))
        swarm.wait_for(lambda: _dashboard_url(a), 120, "A's dashboard address in its log")
        url = _dashboard_url(a)
        # every peer has trained a window of inner steps: a loss (and its first eval) in every history
        swarm.wait_for(lambda: all(p.of("inner") for p in (a, b, c)), 180, "inner steps on every peer")
        swarm.wait_for(lambda: len(_get(url + "api/peers")["peers"]) == 3, 60, "3 peers on A's dashboard")
        yield SimpleNamespace(swarm=swarm, a=a, b=b, c=c, url=url, tmp=tmp, dash=dash)
    finally:
        swarm.close()


def _chrome():
    """A headless Chromium driven by Selenium (Debian's chromium + chromium-driver), or a skip saying what is
    missing."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e .[test])")
    if not chromium or not driver:
        pytest.skip("no chromium + chromedriver (scripts/setup installs Debian's chromium and chromium-driver as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1500,1100",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-default-apps", "--disable-extensions"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def _wait(what: str, condition, timeout_s: float = 60.0):
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            value = condition()
        except StaleElementReferenceException:  # the page re-rendered between finding an element and reading it
            value = None
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_browser_shows_peers_and_curves_and_pauses(run):
    browser = _chrome()
    try:
        browser.get(run.url)
        rows = _wait("3 rows in the peers table",
                     lambda: (r := browser.find_elements("css selector", "#peers tr")) and len(r) == 3 and r)
        assert len(rows) == 3
        points = _wait("points in the loss plot", lambda: browser.execute_script(
            "const d = document.getElementById('loss-plot').data;"
            "return d ? d.reduce((n, t) => n + t.y.filter(v => v !== null).length, 0) : 0;"))
        assert points > 0
        evals = browser.execute_script(
            "return document.getElementById('eval-plot').data.reduce((n, t) => n + t.y.length, 0);")
        assert evals > 0
        _wait("this machine's panel", lambda: browser.find_element("id", "node-panel").is_displayed())
        # which peer this machine is: A, named in the panel, marked in the table and in the curves' legend
        a_id = next(json.loads(line)["message"].split()[1] for line in run.a.log.read_text().splitlines()
                    if json.loads(line).get("message", "").startswith("PeerID "))
        assert browser.execute_script("return document.getElementById('node-peer').title;") == a_id
        _wait("A's row marked as this machine", lambda: browser.execute_script(
            "return [...document.querySelectorAll('#peers tr.mine')].map(r => r.dataset.peer);") == [a_id])
        # a legend says which colour is which peer: one entry per peer, A's saying so, colours all different
        legend = _wait("a legend entry per peer in the loss plot", lambda: (names := browser.execute_script(
            "return [...document.querySelectorAll('#loss-plot .legend .traces .legendtext')].map(e => e.textContent);"
        )) and len(names) == 3 and names)
        assert sum(name.endswith("(this machine)") for name in legend) == 1, legend
        colours = browser.execute_script("return document.getElementById('loss-plot').data.map(t => t.line.color);")
        assert len(set(colours)) == 3, colours
        # what each peer contributed, ranked by tokens trained, this machine's row marked
        ranked = _wait("a contribution row per peer", lambda: (rows := browser.execute_script(
            "return [...document.querySelectorAll('#contribution tr')].map(r => [r.dataset.peer, "
            "...[...r.cells].map(c => c.textContent)]);")) and len(rows) == 3 and rows)
        assert [row[1] for row in ranked] == ["1", "2", "3"], ranked
        tokens = [int(row[3].replace(",", "")) for row in ranked]
        assert tokens == sorted(tokens, reverse=True) and tokens[-1] > 0, ranked
        assert sorted(row[0] for row in ranked) == sorted(p["peer"] for p in _get(run.url + "api/peers")["peers"])
        assert sum(row[2].endswith("(this machine)") for row in ranked) == 1, ranked
        # rounds are whole numbers: the MB-per-round chart ticks only integers
        xaxis = browser.execute_script("return document.getElementById('bytes-plot').layout.xaxis;")
        assert xaxis["tickformat"] == "d" and xaxis["dtick"] >= 1 and xaxis["dtick"] == int(xaxis["dtick"]), xaxis
        # what is in use, not only the setting: A runs with --device auto
        import torch

        used = "cuda" if torch.cuda.is_available() else "cpu"
        limits = dict(browser.execute_script(  # read in one go: the panel is redrawn every poll
            "return [...document.querySelectorAll('#node-limits tr')].map(r => [...r.cells].map(c => c.textContent));"))
        assert limits["device"] == f"{used} (device = auto)", limits
        assert browser.execute_script("return document.getElementById('rule-gpu').textContent;") == (
            f"on, in use ({used})" if used == "cuda" else "allowed, not in use (training on cpu)")
        # snooze for 4 h from the page, then lift it
        browser.find_element("css selector", ".snooze button[data-for='4h']").click()
        _wait("the snooze on the page", lambda: browser.execute_script(
            "return document.getElementById('node-reasons').textContent;").startswith("snoozed until"))
        assert _get(run.url + "api/node")["status"]["snoozed_until"] > time.time() + 3 * 3600
        browser.find_element("css selector", ".snooze button[data-for='off']").click()
        _wait("the snooze lifted", lambda: browser.execute_script(
            "return document.getElementById('node-state').textContent;") != "paused")
        browser.find_element("id", "pause").click()
        _wait("the paused state on the page", lambda: browser.find_element("id", "node-state").text == "paused")
        # A's status record, read back from the DHT: the only paused peer
        _wait("A's row paused", lambda: [r.find_element("css selector", "td:nth-child(2)").text
                                         for r in browser.find_elements("css selector", "#peers tr")].count("paused")
              == 1, 30)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        browser.quit()


def test_api_matches_peerd_status(run):
    bootstrap = run.swarm.bootstrap_maddr
    # freeze every peer's fields (only `time` keeps moving): the two readers must then agree exactly
    for peer in (run.a, run.b, run.c):
        reply = control.request(run.tmp / f"ckpt-{peer.name}" / "peerd.sock", {"cmd": "pause"})
        assert reply["ok"] and reply["paused"], reply
    run.swarm.wait_for(lambda: _dashboard_url(run.dash), 90, "`peerd dashboard` serving")
    url = _dashboard_url(run.dash)
    assert url.startswith("http://127.0.0.1:")

    def all_paused() -> bool:
        rows = _get(url + "api/peers")["peers"]
        return len(rows) == 3 and all(r["role"] == "paused" for r in rows)

    run.swarm.wait_for(all_paused, 60, "3 paused peers on `peerd dashboard`")
    time.sleep(1.5)  # a record published in the instant of the pause is superseded by now
    out = subprocess.run(peerd_cmd("status", "--run-id", RUN, "--initial-peers", bootstrap, "--host-maddrs",
                                   "/ip4/127.0.0.1/tcp/0", "--json"), capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    read = time.time()
    run.swarm.wait_for(lambda: (_get(url + "api/run")["read_at"] or 0) > read, 30, "the dashboard's next read")
    peers = {r["peer"]: r for r in _get(url + "api/peers")["peers"]}
    history = _get(url + "api/history")["peers"]
    view = _get(url + "api/run")
    live = {p: s for p, s in status["peers"].items() if s["role"] != "left"}
    assert set(peers) == set(live) and len(peers) == 3
    for peer, record in live.items():
        assert record["role"] == "paused"
        for field in ("role", "outer_round", "inner_step", "loss", "tokens_per_s", "eval_nats_per_byte", "digest",
                      "instance", "stage", "v"):
            assert peers[peer][field] == record[field], (peer, field)
        assert history[peer] == record["history"], peer
        assert record["history"]["loss"] and record["history"]["eval"], peer
    assert view["live_peers"] == 3 and view["training_peers"] == 0
    assert view["outer_round"] == max(s["outer_round"] for s in live.values())
    assert view["config"]["fingerprint"] == status["config"]["fingerprint"]
    assert view["config"]["creator"] == status["config"]["creator"]
    # this machine's panel answers through A's control socket
    node = _get(url + "api/node")
    assert node["available"] and node["status"]["paused"] and node["health"]["healthy"]
    assert "user" in node["status"]["pause_reasons"]
