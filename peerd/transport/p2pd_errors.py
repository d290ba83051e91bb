"""What a request to p2pd (Go ``p2pd``, or peerd's py-libp2p daemon behind the same control protocol) raises when it
fails, through hivemind's p2pd client: one tuple for the handlers that turn such a failure into their answer (a
ConnectionError that names the cause, a FAIL line, a stop that goes on).

Read from hivemind 1.1.12's ``p2p_daemon_bindings`` (``control.py``, ``utils.py``) and ``P2P.create``: p2pd refuses
or fails a request (``ControlFailure``, ``DispatchFailure``: :class:`P2PDaemonError`); its control socket cannot be
opened or closes mid-answer (OSError; ``asyncio.IncompleteReadError``, an EOFError); an answer does not parse
(ValueError for an overlong varint or a bad multiaddr, protobuf's DecodeError); a bounded wait runs out
(``asyncio.TimeoutError``, an OSError from Python 3.11 on).
"""

from __future__ import annotations

import asyncio

from google.protobuf.message import DecodeError
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

P2PD_ERRORS: tuple[type[BaseException], ...] = (P2PDaemonError, OSError, EOFError, ValueError, DecodeError,
                                               asyncio.TimeoutError)
