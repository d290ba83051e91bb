"""One side of an RPC stream: messages in both directions, each of any size."""

from __future__ import annotations

from typing import Any, Optional

from protocols.interfaces import PeerStreams, StreamReader, StreamWriter
from protocols.rpc.errors import _guard
from protocols.rpc.framing import CHUNK_BYTES, Message, Payload, _check_keys, _reply_message, read_message, send_message


class RpcStream:
    """One side of an RPC stream: messages in both directions, each of any size (chunked on the wire).

    The caller's side comes from :func:`open_stream`; a handler's side is :attr:`Request.stream`. ``recv`` returns
    None once the other side ended its messages. ``bytes_sent`` / ``bytes_received`` count every byte.
    """

    def __init__(self, reader: StreamReader, writer: StreamWriter, peer: str, *, caller: bool,
                 chunk_bytes: int = CHUNK_BYTES):
        self.reader, self.writer, self.peer = reader, writer, peer
        self.caller = caller
        self.chunk_bytes = chunk_bytes
        self.bytes_sent = 0
        self.bytes_received = 0
        self._remote_ended = False

    async def send(self, header: Optional[dict[str, Any]] = None, payload: Payload = b"",
                   timeout_s: Optional[float] = None) -> int:
        """Send one message; returns its bytes. Raises RpcTimeout, Unreachable; ValueError on reserved keys."""
        header = _check_keys(header)
        if not self.caller:
            header = {"status": "ok", **header}
        return await self._send(header, payload, timeout_s)

    async def _send(self, header: dict[str, Any], payload: Payload, timeout_s: Optional[float]) -> int:
        sent = await _guard(send_message(self.writer, header, payload, self.chunk_bytes), timeout_s,
                            f"sending to {self.peer}")
        self.bytes_sent += sent
        return sent

    async def recv(self, max_bytes: int, timeout_s: Optional[float] = None) -> Optional[Message]:
        """The next message (payload at most ``max_bytes``), or None once the other side ended its messages.

        Raises RpcTimeout, Unreachable (stream closed or broken), ProtocolViolation, and on the caller's side
        Refused (the handler refused).
        """
        if self._remote_ended:
            return None
        message = await _guard(read_message(self.reader, max_bytes), timeout_s, f"receiving from {self.peer}")
        self.bytes_received += message.nbytes
        if self.caller:
            message = _reply_message(message)
        elif message.header.pop("_end", None) is True:
            message = None
        if message is None:
            self._remote_ended = True
        return message

    async def end(self, timeout_s: Optional[float] = None) -> None:
        """Tell the other side this one sends no more messages (its ``recv`` then returns None)."""
        await self._send({"status": "end"} if not self.caller else {"_end": True}, b"", timeout_s)

    def close(self) -> None:
        close_writer(self.writer)

    async def __aenter__(self) -> "RpcStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


async def _open(streams: PeerStreams, peer: str, name: str, timeout_s: Optional[float]) -> tuple[Any, Any]:
    return await _guard(streams.open(peer, name), timeout_s, f"opening {name!r} to {peer}")


async def _send_first(stream: RpcStream, header: dict[str, Any], payload: Payload,
                      timeout_s: Optional[float]) -> RpcStream:
    """Send the first message of a stream this side opened; returns ``stream``. If that fails or is cancelled (a
    caller's deadline), the stream is closed before the error goes on."""
    sent = False
    try:
        await stream._send(header, payload, timeout_s)
        sent = True
    finally:
        if not sent:
            stream.close()
    return stream


def close_writer(writer: StreamWriter) -> None:
    """Close ``writer``; closing a stream that already broke does not raise (it is closed either way)."""
    try:
        writer.close()
    except Exception:  # boundary: a transport's close raises its own error types (p2pd streams, uvloop); closed either way
        pass
