"""Who may use the dashboard.

- Bound to a loopback address it needs no login (like the control socket, it is this machine's user's).
- Bound anywhere else it needs a token (``dashboard_token``, at least :data:`MIN_TOKEN_CHARS` characters): a
  request brings it as ``?token=`` (the page then keeps it in a cookie) or as ``Authorization: Bearer``. Without
  one the dashboard refuses to start.
- A request whose ``Host`` names another machine is refused (a DNS-rebinding page cannot reach a loopback
  dashboard), and an action (``POST``) must carry the header ``X-Peerd-Dashboard`` (a cross-site form cannot set
  it, and a cross-site script needs a CORS preflight the dashboard never grants).

Pure: no aiohttp here. The binding rule lives in :mod:`peerd.node_values`, where the node config checks it too.
"""

from __future__ import annotations

import hmac
from typing import Optional

from peerd.node_values import MIN_TOKEN_CHARS, bind_problem, is_loopback  # noqa: F401 (re-exported)

#: Header every action request must carry.
ACTION_HEADER = "X-Peerd-Dashboard"
COOKIE = "peerd_dashboard_token"


def token_ok(expected: Optional[str], given: Optional[str]) -> bool:
    """True if no token is required or ``given`` equals it (compared in constant time)."""
    if not expected:
        return True
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


def host_ok(host_header: Optional[str], bound_host: str, port: int) -> bool:
    """True if the request's ``Host`` header names this dashboard: its bound address, or a loopback name when
    bound to loopback, or anything when bound to all addresses with a token (the token then guards)."""
    if not host_header:
        return False
    name = host_header.rsplit(":", 1)[0] if not host_header.endswith("]") else host_header
    if bound_host in ("0.0.0.0", "::"):
        return True
    if is_loopback(bound_host):
        return is_loopback(name)
    return name.strip("[]") == bound_host.strip("[]")
