"""Download of the current training state from a live peer (how a joiner catches up with the swarm).

A serving peer is an RPC service (:mod:`protocols.rpc`) named ``prefix`` with one method, ``state`` (stream handler
``<prefix>.state``). It answers with one message: a header describing the tensors (name, dtype, numel, in order)
plus metadata, and a payload with the raw little-endian bytes of those tensors, back to back. The RPC layer chunks a
payload larger than ``chunk_bytes`` into several frames (64-bit total), so a state of any size (theta + momentum of
a model above 537M parameters included) travels, and the downloader refuses a state larger than its ``max_bytes``
on the header, before reading it. A peer with nothing to serve refuses with code ``unavailable``. The downloader
checks everything against what it expects (names, shapes, dtypes, total size, finite values) before it uses
anything: a bad answer is a :class:`StateTransferFailed`, and the caller tries another peer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from protocols.interfaces import Transport
from protocols.rpc import CHUNK_BYTES, Refused, Request, RpcError, RpcTimeout, Service, call
from protocols.wire import ProtocolViolation, require

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}


@dataclass(frozen=True)
class StateTransferConfig:
    """Timeouts (seconds) of a state download (:func:`download_state`)."""

    download_timeout_s: float = 60.0
    """Longest the download of one peer's whole state (connect, header and payload) may take before the
    downloader gives up on that peer and tries the next; size it for the model's state over the slowest link a
    joiner should still catch up over."""

    def __post_init__(self) -> None:
        if not self.download_timeout_s > 0:
            raise ValueError(f"download_timeout_s must be positive, got {self.download_timeout_s}")


@dataclass(frozen=True)
class StateSnapshot:
    """Serialized state: ``header`` (msgpack-able: tensors spec + metadata) and ``payload`` bytes (bytes-like)."""

    header: dict[str, Any]
    payload: bytes | bytearray

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> "StateSnapshot":
        """Pack CPU tensors (any of float32/float16/bfloat16/int64) and msgpack-able metadata."""
        spec, chunks = [], []
        for name, tensor in tensors.items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise ValueError(f"unsupported dtype {tensor.dtype} for {name}")
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            spec.append([name, dtype, flat.numel()])
            chunks.append(flat.view(torch.uint8).numpy().tobytes())
        return cls({"tensors": spec, "metadata": metadata}, b"".join(chunks))

    def tensors(self, expected: dict[str, tuple[torch.dtype, int]]) -> dict[str, torch.Tensor]:
        """Unpack and validate against ``expected`` = {name: (dtype, numel)}. Raises ProtocolViolation."""
        spec = require(self.header, "tensors", list)
        for entry in spec:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                    and isinstance(entry[1], str) and isinstance(entry[2], int) and not isinstance(entry[2], bool)):
                raise ProtocolViolation(f"malformed tensor entry {entry!r}")
        names = [entry[0] for entry in spec]
        if sorted(names) != sorted(expected):
            raise ProtocolViolation(f"state has tensors {names}, expected {sorted(expected)}")
        out, offset = {}, 0
        for name, dtype_name, numel in spec:
            dtype, want_numel = expected[name]
            if _DTYPES.get(dtype_name) != dtype or numel != want_numel:
                raise ProtocolViolation(f"{name}: got {dtype_name} x {numel}, expected {dtype} x {want_numel}")
            size = numel * dtype.itemsize
            if offset + size > len(self.payload):
                raise ProtocolViolation("state payload shorter than its header says")
            if size == 0:
                tensor = torch.empty(0, dtype=dtype)
            else:
                tensor = torch.frombuffer(bytearray(memoryview(self.payload)[offset : offset + size]), dtype=dtype)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ProtocolViolation(f"{name} has non-finite values")
            out[name] = tensor
            offset += size
        if offset != len(self.payload):
            raise ProtocolViolation("state payload longer than its header says")
        return out

    @property
    def metadata(self) -> dict[str, Any]:
        metadata = self.header.get("metadata")
        if not isinstance(metadata, dict):
            raise ProtocolViolation("state header lacks metadata")
        return metadata


class StateTransferFailed(Exception):
    """The peer could not be reached or sent an unusable state."""


class StateServer(Service):
    """Serves the latest snapshot returned by ``get_snapshot`` (None = nothing to serve yet).

    ``chunk_bytes`` is the largest payload per frame of an answer (tests set it small).
    """

    def __init__(self, transport: Transport, prefix: str, get_snapshot: Callable[[], Optional[StateSnapshot]],
                 chunk_bytes: int = CHUNK_BYTES):
        self.transport = transport
        self.prefix = self.name = prefix
        self.get_snapshot = get_snapshot
        self.chunk_bytes = chunk_bytes
        self.served = 0

    @property
    def handler_name(self) -> str:
        return self.handler_name_of("state")

    async def rpc_state(self, request: Request) -> None:
        snapshot = self.get_snapshot()
        if snapshot is None:
            raise Refused("no state to serve yet", "unavailable")
        self.served += 1  # before the bytes leave, as :class:`protocols.blobs.BlobServer` counts
        try:
            await request.reply(snapshot.header, snapshot.payload)
        except RpcError as e:
            self.served -= 1
            logger.info("state upload to %s failed: %s", request.peer, e)
            return
        logger.info("served state (%d bytes) to %s", len(snapshot.payload), request.peer)


async def download_state(
    transport: Transport, prefix: str, peer: str, max_bytes: int, timeout_s: float
) -> StateSnapshot:
    """Fetch ``peer``'s snapshot (at most ``max_bytes`` of payload) within ``timeout_s`` seconds.

    Raises StateTransferFailed on any network failure, timeout, refusal or oversized/malformed answer; the returned
    snapshot still has to be validated with :meth:`StateSnapshot.tensors`.
    """
    try:
        reply = await call(transport.streams, peer, prefix, "state", timeout_s=timeout_s, max_reply_bytes=max_bytes)
    except RpcTimeout:
        raise StateTransferFailed(f"{peer} did not send its state within {timeout_s} s") from None
    except Refused as e:
        raise StateTransferFailed(f"{peer} has no state to serve ({e.code}: {e.reason})") from e
    except RpcError as e:
        raise StateTransferFailed(f"state download from {peer} failed: {e}") from e
    return StateSnapshot(reply.header, reply.payload)
