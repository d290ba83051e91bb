"""Download of the current training state from a live peer (how a joiner catches up with the swarm).

A serving peer answers ``<prefix>.state`` streams with one frame: a header describing the tensors (name, dtype,
numel, in order) plus metadata, and a payload with the raw little-endian bytes of those tensors, back to back. The
downloader checks everything against what it expects (names, shapes, dtypes, total size, finite values) before it
uses anything: a bad answer is a :class:`StateTransferFailed`, and the caller tries another peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from protocols.interfaces import StreamReader, StreamWriter, Transport
from protocols.wire import ProtocolViolation, read_frame, require, write_frame

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
    """Serialized state: ``header`` (msgpack-able: tensors spec + metadata) and ``payload`` bytes."""

    header: dict[str, Any]
    payload: bytes

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
                tensor = torch.frombuffer(bytearray(self.payload[offset : offset + size]), dtype=dtype)
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


class StateServer:
    """Serves the latest snapshot returned by ``get_snapshot`` (None = nothing to serve yet)."""

    def __init__(self, transport: Transport, prefix: str, get_snapshot: Callable[[], Optional[StateSnapshot]]):
        self.transport = transport
        self.prefix = prefix
        self.get_snapshot = get_snapshot
        self.served = 0

    @property
    def handler_name(self) -> str:
        return f"{self.prefix}.state"

    async def start(self) -> None:
        await self.transport.streams.add_handler(self.handler_name, self._serve)

    async def stop(self) -> None:
        await self.transport.streams.remove_handler(self.handler_name)

    async def _serve(self, peer: str, reader: StreamReader, writer: StreamWriter) -> None:
        snapshot = self.get_snapshot()
        with contextlib.suppress(ConnectionError, OSError):
            if snapshot is None:
                await write_frame(writer, {"status": "unavailable"})
                return
            await write_frame(writer, {"status": "ok", **snapshot.header}, snapshot.payload)
            self.served += 1
            logger.info("served state (%d bytes) to %s", len(snapshot.payload), peer)


async def download_state(
    transport: Transport, prefix: str, peer: str, max_bytes: int, timeout_s: float
) -> StateSnapshot:
    """Fetch ``peer``'s snapshot (at most ``max_bytes`` of payload) within ``timeout_s`` seconds.

    Raises StateTransferFailed on any network failure, timeout, refusal or oversized/malformed answer; the returned
    snapshot still has to be validated with :meth:`StateSnapshot.tensors`.
    """

    async def fetch() -> StateSnapshot:
        reader, writer = await transport.streams.open(peer, f"{prefix}.state")
        try:
            header, payload, _ = await read_frame(reader, max_bytes)
        finally:
            writer.close()
        if header.get("status") != "ok":
            raise StateTransferFailed(f"{peer} has no state to serve ({header.get('status')!r})")
        header.pop("status")
        return StateSnapshot(header, payload)

    try:
        return await asyncio.wait_for(fetch(), timeout_s)
    except asyncio.TimeoutError:
        raise StateTransferFailed(f"{peer} did not send its state within {timeout_s} s") from None
    except (ConnectionError, OSError, ProtocolViolation) as e:
        raise StateTransferFailed(f"state download from {peer} failed: {e}") from e
