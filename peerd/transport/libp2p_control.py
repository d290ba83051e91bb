"""The p2pd control protocol's messages and framing, and the identity key file, for
:mod:`peerd.transport.libp2p_daemon`.

Messages are hivemind's ``p2pd_pb2`` (package ``p2pclient.p2pd.pb``), loaded from its file outside the ``hivemind``
package (importing hivemind beside py-libp2p fails: both register ``crypto.pb.KeyType``). On the control socket and
on unary-call streams each message is varint-delimited (an unsigned LEB128 length, then the serialized protobuf), as
go-libp2p-daemon writes them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Awaitable, Callable

import multiaddr
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair

#: Largest control or unary message accepted (hivemind's DEFAULT_MAX_MSG_SIZE is 4 MiB; p2pd allows this too).
MAX_MESSAGE_BYTES = 8 << 20
#: Bytes per read when piping a stream.
PIPE_CHUNK = 1 << 16


def load_p2pd_pb2() -> Any:
    spec = importlib.util.find_spec("hivemind")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("hivemind is not installed: its p2pd.proto messages are needed")
    path = Path(spec.submodule_search_locations[0]) / "proto" / "p2pd_pb2.py"
    module_spec = importlib.util.spec_from_file_location("peerd_p2pd_pb2", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


pb = load_p2pd_pb2()


def key_pair_from_identity(blob: bytes) -> KeyPair:
    """A py-libp2p key pair from a serialized libp2p ``PrivateKey`` protobuf of type Ed25519 (the format of
    :mod:`peerd.identity.key`: field 1 = key type 1, field 2 = 32-byte seed + 32-byte public key). Raises ValueError."""
    key_type, data, i = None, None, 0
    while i < len(blob):  # the two fields by hand: the libp2p crypto protobuf module cannot be used beside others
        tag, i = read_varint(blob, i)
        if tag == 0x08:
            key_type, i = read_varint(blob, i)
        elif tag == 0x12:
            n, i = read_varint(blob, i)
            data, i = blob[i:i + n], i + n
        else:
            raise ValueError(f"unexpected field tag {tag} in the identity key")
    if key_type != 1 or data is None or len(data) not in (32, 64):
        raise ValueError("the identity is not an Ed25519 libp2p private key")
    private = Ed25519PrivateKey.new(bytes(data[:32]))
    return KeyPair(private, private.get_public_key())


def read_varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


class Reader:
    """Buffered reads (exact sizes, varint-delimited protobufs) over any ``receive(max_bytes) -> bytes``."""

    def __init__(self, receive: Callable[[int], Awaitable[bytes]]):
        self._receive = receive
        self._buf = bytearray()

    async def _fill(self) -> None:
        data = await self._receive(PIPE_CHUNK)
        if not data:
            raise EOFError("stream closed")
        self._buf += data

    async def exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            await self._fill()
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def varint(self) -> int:
        value = shift = 0
        while True:
            b = (await self.exactly(1))[0]
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value
            if shift > 63:
                raise ValueError("varint too long")

    async def message(self, message: Any) -> Any:
        size = await self.varint()
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
        message.ParseFromString(await self.exactly(size))
        return message

    def take_buffered(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


def delimited(message: Any) -> bytes:
    data = message.SerializeToString()
    return encode_varint(len(data)) + data


async def stream_receive(stream: Any, n: int) -> bytes:
    from libp2p.network.stream.exceptions import StreamEOF

    try:
        return await stream.read(n)
    except StreamEOF:
        return b""


def remote_maddr(stream: Any) -> bytes:
    try:
        host, port = stream.get_remote_address()
        return multiaddr.Multiaddr(f"/ip4/{host}/tcp/{port}").to_bytes()
    except (TypeError, ValueError):  # an address we cannot tell (None: unknown; not IPv4) is reported as none
        return b""
