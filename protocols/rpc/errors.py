"""The typed failures of an RPC (callers never parse strings) and the deadline helpers that raise them."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Optional

from protocols.wire import ProtocolViolation, RpcError

__all__ = ["ProtocolViolation", "Refused", "RpcError", "RpcTimeout", "Unreachable", "until"]


class RpcTimeout(RpcError):
    """The exchange did not finish within its time limit."""


class Unreachable(RpcError):
    """No stream could be opened to the peer, or the stream broke or was closed between messages."""


class Refused(RpcError):
    """The remote answered with a refusal. Handlers raise it to refuse; callers receive it with the same fields.

    Args:
        reason: human-readable why (logged, never parsed).
        code: machine-readable kind, e.g. ``"refused"``, ``"busy"``, ``"unavailable"``; the dispatcher itself uses
            ``"protocol"`` (bad request), ``"timeout"`` (request not delivered in time) and ``"internal"`` (the
            handler failed).
    """

    def __init__(self, reason: str, code: str = "refused"):
        super().__init__(f"{code}: {reason}")
        self.reason = reason
        self.code = code


async def until(awaitable: Awaitable[Any], deadline: Optional[float]) -> Any:
    """Await ``awaitable`` until ``deadline`` (event-loop time; None: no deadline). Raises asyncio.TimeoutError past
    it. On Python 3.11+ this is one timer (``asyncio.timeout_at``), no task: cheap enough to bound a whole pipelined
    exchange where a ``wait_for`` per step would cost a task and a timer per frame; older Pythons use ``wait_for``."""
    if deadline is None:
        return await awaitable
    timeout_at = getattr(asyncio, "timeout_at", None)
    if timeout_at is None:
        return await asyncio.wait_for(awaitable, max(deadline - asyncio.get_running_loop().time(), 0.0))
    async with timeout_at(deadline):
        return await awaitable


async def _guard(awaitable: Awaitable[Any], timeout_s: Optional[float], what: str) -> Any:
    """Await with an optional deadline and map transport failures onto the RPC error classes."""
    try:
        if timeout_s is None:
            return await awaitable
        return await asyncio.wait_for(awaitable, max(timeout_s, 0.0))
    except asyncio.TimeoutError:
        raise RpcTimeout(f"{what} did not finish within {timeout_s} s") from None
    except (ConnectionError, OSError) as e:
        raise Unreachable(f"{what}: {type(e).__name__}: {e}") from e
