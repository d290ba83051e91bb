"""Keep a served stream open until the remote closed it, so that the handler's last answer is not lost.

Closing our end first can lose the answer on p2pd (hivemind's go-libp2p-daemon): when our side of the unix socket
closes, p2pd's stream pipe closes the libp2p stream, and go-yamux's ``Close`` is ``CloseRead`` then ``CloseWrite``;
the ``CloseRead`` wakes the pipe's other goroutine with ``ErrStreamReset``, which calls ``Reset``. When that reset wins
the race against the FIN, the remote's yamux drops the answer bytes it had buffered but not yet read, and the remote
sees "stream ended mid-payload" (seen on ~1 in 1,000 large answers under CPU load). On TCP (the direct data plane),
closing a socket with unread received bytes (a request refused before its payload was read) sends a reset that can
likewise discard the answer at the remote. Both are avoided by reading (and dropping) until the remote's EOF.

The RPC layer (:mod:`protocols.rpc`) has callers close their stream once they have read the last message they
expect, so the wait is short; :data:`CLOSE_LINGER_S` bounds it for a remote that never closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

logger = logging.getLogger(__name__)

#: After a handler returns, how long its stream stays open for the remote to read the last answer and close first.
CLOSE_LINGER_S = 5.0


async def until_remote_closes(reader: Any, timeout_s: float = CLOSE_LINGER_S) -> None:
    """Wait (at most ``timeout_s``) for the remote's EOF, discarding anything it still sends.

    ``reader`` needs ``read(n)`` (returns b"" at EOF) or else ``readexactly(n)``. Never raises: EOF
    (IncompleteReadError), a reset (ConnectionError), the timeout and a read still waiting elsewhere (RuntimeError
    from the multiplexed and direct streams) all mean the stream may be closed now.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    read = getattr(reader, "read", None)
    with contextlib.suppress(OSError, EOFError, RuntimeError):
        if read is None:
            while True:
                await asyncio.wait_for(reader.readexactly(1), max(0.0, deadline - loop.time()))
        while await asyncio.wait_for(read(1 << 16), max(0.0, deadline - loop.time())):
            pass


async def serve_stream(handler: Any, peer: str, reader: Any, writer: Any, name: str) -> None:
    """How a transport serves one incoming stream: ``await handler(peer, reader, writer)``, then, once it answered,
    :func:`until_remote_closes`. A handler that fails is logged with its traceback; the caller closes the stream
    either way."""
    try:
        await handler(peer, reader, writer)
    except Exception:  # boundary: a handler's failure on one peer's stream ends that stream, never the transport
        logger.exception("stream handler %s failed for %s", name, peer)
    else:  # closing with unread bytes would reset the connection and could drop our answer
        await until_remote_closes(reader, CLOSE_LINGER_S)
