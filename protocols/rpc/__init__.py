"""Request/response and streaming RPC between peers, on any :class:`protocols.interfaces.PeerStreams`.

Every protocol of peerd (matchmaking, all-reduce, gossip, state transfer, pipeline stages next) talks through this
package: a :class:`Service` serves methods, :func:`call` makes one request/response exchange and :func:`open_stream`
opens a bidirectional stream of messages. Failures are typed, so callers never parse strings: every one is an
:class:`RpcError`, one subclass per failure class:

- :class:`RpcTimeout`: the exchange did not finish within its time limit;
- :class:`Unreachable`: no stream could be opened, or the stream broke or was closed between messages (the peer is
  gone; not evidence of malice);
- :class:`ProtocolViolation` (from :mod:`protocols.wire`): the peer sent bytes that break the protocol (oversized,
  truncated mid-message, malformed); raised on the side that read them, which excludes (bans) that peer;
- :class:`Refused`: the remote answered with a refusal (``code`` says which kind, ``reason`` says why); a handler
  that raises becomes a refusal on the caller, never a hung caller.

**How a message travels.** A stream is opened to the handler name ``<service>.<method>`` (e.g. ``run.reduce``).
A *message* is a msgpack header plus a payload of any length (up to 2**63 bytes), carried by frames of
:mod:`protocols.wire` (``u32 header_length | u32 payload_length | header | payload``). A payload of at most
``chunk_bytes`` rides in one frame: the message is that frame, byte for byte. A longer payload is chunked: the
first frame's header gets ``"_total": <payload bytes>`` (a 64-bit msgpack integer) and carries the first chunk;
continuation frames have an empty header ``{}`` and carry the next chunks, until ``_total`` bytes have arrived.
The reader checks every size before reading it: ``_total`` (or the single frame's length) against the limit the
receiving code set for that message, the first chunk against ``_total``, each continuation chunk against what
remains; it allocates the payload only after the checks.

A call is the request message, then one reply message whose header has ``"status"``: ``"ok"`` (the handler's
header fields sit beside it), or ``"refused"`` with ``"code"`` and ``"reason"``. A stream is a request whose header
has ``"_stream": true``; then both sides send messages in any order; the handler's side ends with a
``{"status": "end"}`` message (or a refusal), the caller's side with ``{"_end": true}``. Keys ``status``, ``code``,
``reason`` and every key starting with ``_`` are the envelope's: handlers and callers may not use them.

Closing: the caller closes its stream once it has read the last message it expects; a handler's side returns and
the transport closes it. (Transports on which closing first can drop the last answer, such as p2pd's yamux, keep
the handler's side open until the caller closed: see :mod:`peerd.transport.linger`.)

The package, one concept a module: :mod:`~protocols.rpc.framing` (messages and frames on a stream),
:mod:`~protocols.rpc.errors` (the typed failures and deadlines), :mod:`~protocols.rpc.stream` (one side of a stream
of messages), :mod:`~protocols.rpc.client` (the calling side) and :mod:`~protocols.rpc.server` (the serving side).
"""

from protocols.rpc.client import call, call_framed, open_stream
from protocols.rpc.errors import ProtocolViolation, Refused, RpcError, RpcTimeout, Unreachable, until
from protocols.rpc.framing import (
    CHUNK_BYTES, MAX_TOTAL_BYTES, Message, Payload, Reply, handler_name, read_message, send_message,
)
from protocols.rpc.server import MethodHandler, Request, Service
from protocols.rpc.stream import RpcStream

__all__ = [
    "CHUNK_BYTES", "MAX_TOTAL_BYTES", "Message", "MethodHandler", "Payload", "ProtocolViolation", "Refused", "Reply",
    "Request", "RpcError", "RpcStream", "RpcTimeout", "Service", "Unreachable", "call", "call_framed",
    "handler_name", "open_stream", "read_message", "send_message", "until",
]
