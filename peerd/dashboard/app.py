"""The dashboard's web server (aiohttp): the page, its static assets and the JSON API behind every panel.

API (all JSON; times Unix seconds, losses nats per byte, or per token where `/api/run` says `loss_unit` "token"):

- ``GET /api/run``: the run panel (:func:`peerd.dashboard.view.run_view`).
- ``GET /api/peers``: ``{"peers": [row, ...]}`` (:func:`peerd.dashboard.view.peers_view`).
- ``GET /api/history``: curves per peer and the run's tokens/s (:func:`peerd.dashboard.view.history_view`).
- ``GET /api/node``: this machine's daemon (its control-socket ``status`` and ``health`` replies, its rounds), or
  ``{"available": false, "error": ...}`` where no daemon answers.
- ``POST /api/node/{pause,resume,pause_after_round}`` and ``POST /api/node/rules`` (body: rule -> value): the
  control socket's commands, with its rules (only this machine's user: see :mod:`peerd.dashboard.security`).

The server reads the run every ``poll_s`` seconds in the background; requests are answered from that snapshot, so
any number of open pages costs the DHT nothing more. Plotly's JavaScript is served from the installed ``plotly``
Python package (MIT licence); the page loads nothing from the internet.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from importlib import resources
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from peerd.dashboard import security
from peerd.dashboard.view import history_view, peers_view, run_view
from peerd.runtime.processes import reap

logger = logging.getLogger(__name__)

#: Seconds between two reads of the run's status records.
POLL_S = 2.0
#: Points per peer (and for the run) the dashboard keeps of what it sampled itself.
MAX_SAMPLES = 720

ReadRun = Callable[[], Awaitable[tuple[dict[str, dict], Optional[dict]]]]
NodeRequest = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

STATIC = Path(str(resources.files("peerd.dashboard") / "static"))


def plotly_js() -> Optional[Path]:
    """The plotly.min.js shipped inside the ``plotly`` Python package, if installed."""
    try:
        import plotly
    except ImportError:
        return None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


class Dashboard:
    """Serves run ``run_id`` as read by ``read_run``; ``node``: this machine's daemon (a control request -> reply
    coroutine), or None. ``ttl_s``: the run's status record lifetime (a peer older than half of it is stale)."""

    def __init__(self, run_id: str, read_run: ReadRun, node: Optional[NodeRequest] = None,
                 token: Optional[str] = None, ttl_s: float = 30.0, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.time):
        self.run_id = run_id
        self.read_run = read_run
        self.node = node
        self.token = token
        self.ttl_s = ttl_s
        self.poll_s = poll_s
        self.clock = clock
        self.peers: dict[str, dict] = {}
        self.config: Optional[dict] = None
        self.read_at: Optional[float] = None
        self.read_error: Optional[str] = None
        self.sampled: dict[str, collections.deque] = {}
        self.run_samples: collections.deque = collections.deque(maxlen=MAX_SAMPLES)
        self.rounds: collections.deque = collections.deque(maxlen=200)
        """This machine's outer rounds (fed by the daemon's events when the dashboard runs inside it)."""
        self.bans: collections.deque = collections.deque(maxlen=100)
        """Peers this machine banned (time, peer, reason), newest last."""
        self.host = "127.0.0.1"
        self.port: Optional[int] = None
        self._runner: Optional[web.AppRunner] = None
        self._poller: Optional[asyncio.Task] = None
        self._refreshed = asyncio.Event()

    # ------------------------------------------------------------------------------------------------- reading

    async def refresh(self) -> None:
        """Read the run once and record a sample of every peer's values."""
        try:
            peers, config = await self.read_run()
        except Exception as e:  # boundary: the poll loop; the DHT may be unreachable: show the last view, say why
            self.read_error = f"{type(e).__name__}: {e}"
            logger.debug("dashboard: reading the run failed", exc_info=True)
            return
        now = self.clock()
        self.peers, self.config, self.read_at, self.read_error = peers, config, now, None
        live_tps = 0.0
        for peer, r in peers.items():
            if r.get("role") == "left":
                continue
            samples = self.sampled.setdefault(peer, collections.deque(maxlen=MAX_SAMPLES))
            if not samples or samples[-1][0] != r["time"]:
                samples.append([r["time"], None, r.get("loss"), r.get("tokens_per_s"), r.get("eval_nats_per_byte")])
            if r.get("role") not in ("paused", "starting", "syncing"):
                live_tps += r.get("tokens_per_s") or 0.0
        live = sum(1 for r in peers.values() if r.get("role") != "left")
        self.run_samples.append([round(now, 1), round(live_tps, 1), live])
        self._refreshed.set()

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.poll_s)

    def observe(self, event: Any) -> None:
        """Event-bus subscriber (inside a daemon): keeps this machine's rounds (bytes per round, failures) and bans."""
        from peerd.events import event_fields

        f = event_fields(event)
        kind = f.get("event")
        if kind in ("outer_round", "stage_round"):
            self.rounds.append({"time": round(self.clock(), 1), "outer_round": f.get("outer_round"), "ok": True,
                                "group_size": f.get("group_size"), "bytes_sent": f.get("bytes_sent"),
                                "bytes_received": f.get("bytes_received"), "round_s": f.get("round_s")})
        elif kind == "ban":
            self.bans.append({"time": round(self.clock(), 1), "peer": f.get("peer"), "reason": f.get("reason")})
        elif kind == "round_failed":
            self.rounds.append({"time": round(self.clock(), 1), "outer_round": f.get("outer_round"), "ok": False,
                                "reason": f.get("reason")})

    # ---------------------------------------------------------------------------------------------- HTTP

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=64 * 1024)
        app.router.add_get("/", self._index)
        app.router.add_get("/api/run", self._run)
        app.router.add_get("/api/peers", self._peers)
        app.router.add_get("/api/history", self._history)
        app.router.add_get("/api/node", self._node)
        app.router.add_post("/api/node/rules", self._rules)
        app.router.add_post("/api/node/{cmd}", self._command)
        app.router.add_get("/static/plotly.min.js", self._plotly)
        app.router.add_static("/static/", STATIC, show_index=False)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not security.host_ok(request.headers.get("Host"), self.host, self.port or 0):
            return web.json_response({"error": "wrong Host header"}, status=403)
        given = (request.query.get("token") or request.cookies.get(security.COOKIE)
                 or request.headers.get("Authorization", "").removeprefix("Bearer ").strip() or None)
        if not security.token_ok(self.token, given):
            return web.json_response({"error": "this dashboard needs its token: open it with ?token=..."},
                                     status=401)
        if request.method not in ("GET", "HEAD") and not request.headers.get(security.ACTION_HEADER):
            return web.json_response({"error": f"actions need the header {security.ACTION_HEADER}"}, status=403)
        response = await handler(request)
        if self.token and request.query.get("token"):
            response.set_cookie(security.COOKIE, self.token, httponly=True, samesite="Strict")
        response.headers.setdefault("Cache-Control", "no-store" if request.path.startswith("/api/") else "max-age=300")
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["X-Frame-Options"] = "DENY"
        return response

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def _plotly(self, request: web.Request) -> web.StreamResponse:
        path = plotly_js()
        if path is None:
            return web.Response(text="/* plotly is not installed: pip install plotly */",
                                content_type="application/javascript")
        return web.FileResponse(path)

    async def _run(self, request: web.Request) -> web.Response:
        now = self.clock()
        view = run_view(self.run_id, self.peers, self.config, now, self.ttl_s)
        view.update(read_at=self.read_at, read_error=self.read_error, has_node=self.node is not None)
        return web.json_response(view)

    async def _peers(self, request: web.Request) -> web.Response:
        return web.json_response({"peers": peers_view(self.peers, self.clock(), self.ttl_s), "read_at": self.read_at})

    async def _history(self, request: web.Request) -> web.Response:
        sampled = {p: list(s) for p, s in self.sampled.items()}
        return web.json_response(history_view(self.peers, sampled, list(self.run_samples)))

    async def _node(self, request: web.Request) -> web.Response:
        if self.node is None:
            return web.json_response({"available": False, "error": "no local daemon (start `peerd join` or pass "
                                      "its --checkpoint-dir)"})
        try:
            status = await self.node({"cmd": "status"})
            health = await self.node({"cmd": "health"})
        except Exception as e:  # boundary: the daemon's handler (in-process, or over its socket) answers the page
            return web.json_response({"available": False, "error": str(e)})
        return web.json_response({"available": bool(status.get("ok")), "status": status, "health": health,
                                  "rounds": list(self.rounds), "bans": list(self.bans)})

    async def _command(self, request: web.Request) -> web.Response:
        cmd = request.match_info["cmd"]
        if cmd == "snooze":  # body {"for": "1h" | "4h" | "tomorrow" | "off"}
            try:
                body = await request.json()
            except ValueError:
                body = None
            if not isinstance(body, dict):
                return web.json_response({"ok": False, "error": 'expected {"for": "1h"}'}, status=400)
            return await self._send({"cmd": "snooze", "for": body.get("for")})
        if cmd not in ("pause", "resume", "pause_after_round"):
            return web.json_response({"ok": False, "error": f"unknown action {cmd!r}"}, status=404)
        return await self._send({"cmd": cmd})

    async def _rules(self, request: web.Request) -> web.Response:
        try:
            rules = await request.json()
        except ValueError:
            return web.json_response({"ok": False, "error": "expected a JSON table of rule -> value"}, status=400)
        return await self._send({"cmd": "set_rules", "rules": rules})

    async def _send(self, payload: dict[str, Any]) -> web.Response:
        if self.node is None:
            return web.json_response({"ok": False, "error": "no local daemon"}, status=409)
        try:
            reply = await self.node(payload)
        except Exception as e:  # boundary: the daemon's handler (in-process, or over its socket) answers the page
            return web.json_response({"ok": False, "error": str(e)}, status=503)
        return web.json_response(reply, status=200 if reply.get("ok") else 400)

    # ---------------------------------------------------------------------------------------------- lifecycle

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Check the binding (:func:`peerd.dashboard.security.bind_problem`: raises ValueError), start polling and
        serve on ``host:port``; returns the bound port. Raises OSError if the port cannot be bound."""
        problem = security.bind_problem(host, self.token)
        if problem:
            raise ValueError(problem)
        self.host = host
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            self._runner = None
            raise
        self.port = site._server.sockets[0].getsockname()[1]  # port 0: the one the OS chose
        self._poller = asyncio.ensure_future(self._poll())
        return self.port

    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}/"

    async def stop(self) -> None:
        if self._poller is not None:
            await reap(self._poller)
            self._poller = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def control_socket_node(path: Path) -> NodeRequest:
    """A node request function that talks to the daemon's control socket at ``path`` (blocking I/O off the loop)."""
    from peerd.service.control import request

    async def send(payload: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: request(path, payload, 5.0))

    return send
