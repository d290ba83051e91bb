"""The fields of a stage call: token ids on the wire, the micro-batch id and the loss of a reply, each checked as
a peer's input (a :class:`protocols.wire.ProtocolViolation` otherwise)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from protocols.wire import ProtocolViolation

_MAX_MB_ID = 128


def encode_tokens(tokens: torch.Tensor) -> tuple[dict[str, Any], bytes]:
    """Token ids (B, T) int64 -> (``{"shape": [B, T]}``, int32 little-endian bytes). Raises ValueError."""
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(f"tokens must be int64 (B, T), got {tokens.dtype} {tuple(tokens.shape)}")
    return {"shape": list(tokens.shape)}, tokens.to(torch.int32).numpy().astype("<i4").tobytes()


def decode_tokens(header: Any, payload: bytes, vocab_size: int) -> torch.Tensor:
    """A peer's token ids: (B, T) int64 with every id in [0, vocab_size). Raises ProtocolViolation."""
    shape = header.get("shape") if isinstance(header, dict) else None
    if (not isinstance(shape, list) or len(shape) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise ProtocolViolation(f"malformed token shape {shape!r}")
    if len(payload) != 4 * shape[0] * shape[1]:
        raise ProtocolViolation(f"{len(payload)} token bytes for shape {shape}")
    ids = np.frombuffer(payload, dtype="<i4").reshape(shape)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ProtocolViolation(f"token id out of [0, {vocab_size})")
    return torch.from_numpy(ids.astype(np.int64))


def _loss_of(header: dict[str, Any]) -> float:
    loss = header.get("loss")
    if not isinstance(loss, float) or not np.isfinite(loss):
        raise ProtocolViolation(f"malformed loss {loss!r}")
    return loss


def _mb_id(header: dict[str, Any]) -> str:
    mb = header.get("mb")
    if not isinstance(mb, str) or not 0 < len(mb) <= _MAX_MB_ID:
        raise ProtocolViolation(f"malformed micro-batch id {mb!r}")
    return mb
