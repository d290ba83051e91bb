"""The local control channel: a Unix stream socket (mode 0600) in the daemon's state folder, never a network port.

Protocol: the client sends one JSON object on one line (``{"cmd": "status" | "pause" | "resume" | "health" |
"pause_after_round" | "set_rules", ...}``; the daemon's handler is
:meth:`peerd.service.volunteer.VolunteerServices.handle`),
the daemon answers one JSON object on one line and closes. One daemon per socket: the server holds an exclusive
``flock`` on ``<socket>.lock`` for its lifetime (:mod:`peerd.runtime.locks`), so a second daemon on the same folder is told
(and runs without a control socket) instead of stealing the first one's socket; the socket and lock of a daemon that
died, even by SIGKILL, are taken over by the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from peerd.runtime import locks

logger = logging.getLogger(__name__)

#: Longest request line the daemon reads, in bytes.
MAX_REQUEST_BYTES = 64 * 1024

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlUnavailable(ConnectionError):
    """No daemon answers on the control socket (not running, or another user's)."""


class ControlServer:
    """Serves ``handler(request) -> reply`` on a Unix socket at ``path``."""

    def __init__(self, path: Path, handler: Handler):
        self.path = Path(path)
        self.handler = handler
        self._server: Optional[asyncio.AbstractServer] = None
        self._lock_fd: Optional[int] = None
        self.holder: Optional[int] = None
        """Pid of the other daemon that serves ``path``, after :meth:`start` returned False."""

    async def start(self) -> bool:
        """Bind the socket (mode 0600; its folder is created with mode 0700). False if another live daemon holds
        it (its pid in :attr:`holder`). Raises OSError if the folder cannot be created or the socket bound."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            self._lock_fd = locks.acquire(f"{self.path}.lock")
        except locks.LockHeld as e:
            self.holder = e.pid
            return False
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by a daemon that died: we hold the lock, so nobody serves it
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is never reachable by others, not even between bind and chmod
        try:
            sock.bind(str(self.path))
        except OSError:
            sock.close()
            self._release_lock()
            raise
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_REQUEST_BYTES)
        return True

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError):  # a client still connected: not waited for longer
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._release_lock()

    def _release_lock(self) -> None:
        locks.release(self._lock_fd)
        self._lock_fd = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readuntil(b"\n"), 5.0)
            request = json.loads(line)
            if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
                raise ValueError("expected a JSON object with a string 'cmd'")
            reply = await self.handler(request)
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
            reply = {"ok": False, "error": f"bad request: {e}"}
        except Exception as e:  # boundary: a bug in a handler must not kill the daemon
            logger.exception("control request failed")
            reply = {"ok": False, "error": f"internal error: {e}"}
        with contextlib.suppress(OSError, TypeError, ValueError):  # the client went away; a reply JSON cannot encode
            writer.write(json.dumps(reply, default=str).encode() + b"\n")
            await writer.drain()
        writer.close()


def request(path: Path, payload: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """Send one request to the daemon at ``path`` and return its reply (blocking).

    Raises:
        ControlUnavailable: no socket, nobody listening, permission denied, or no reply in time.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(str(path))
        except FileNotFoundError:
            raise ControlUnavailable(f"no peerd daemon running (no control socket at {path})") from None
        except ConnectionRefusedError:
            raise ControlUnavailable(f"no peerd daemon running (stale control socket at {path})") from None
        except PermissionError:
            raise ControlUnavailable(f"permission denied on {path}: run as the daemon's user") from None
        sock.sendall(json.dumps(payload).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        raise ControlUnavailable(f"the daemon at {path} did not answer within {timeout_s:.0f} s") from None
    except ControlUnavailable:
        raise
    except OSError as e:
        raise ControlUnavailable(f"control socket {path}: {e}") from None
    finally:
        sock.close()
    try:
        reply = json.loads(data)
    except json.JSONDecodeError:
        raise ControlUnavailable(f"the daemon at {path} sent no valid reply") from None
    if not isinstance(reply, dict):
        raise ControlUnavailable(f"the daemon at {path} sent no valid reply")
    return reply
