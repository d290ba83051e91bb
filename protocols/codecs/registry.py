"""Codecs by wire name (the one table of them) and the N-D tensor interface a peer's message uses:
:func:`get_codec`, :func:`encode_tensor`, :func:`decode_tensor`."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from protocols.codecs.base import _ALL_CODECS, CODECS, DTYPES, Buffer, Codec, TensorHeader
from protocols.codecs.floats import BFloat16Compression, Float16Compression, NoCompression
from protocols.codecs.quantizers import Fp4Compression, Int8Compression
from protocols.codecs.sign import SignCompression
from protocols.codecs.sparse import TopKCompression
from protocols.wire import ProtocolViolation

_CODEC_TYPES = {"none": NoCompression, "fp16": Float16Compression, "bf16": BFloat16Compression,
                "int8": Int8Compression, "fp4": Fp4Compression, "sign": SignCompression,
                "topk": TopKCompression}


def get_codec(name: str) -> Codec:
    """A codec by wire name (one of :data:`CODECS` or :data:`SPARSE_CODECS`), with default parameters. Raises
    ``ValueError`` otherwise."""
    if name not in _CODEC_TYPES:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(_ALL_CODECS)}")
    return _CODEC_TYPES[name]()


def encode_tensor(x: torch.Tensor, codec: str = "none") -> tuple[dict[str, Any], Buffer]:
    """Encode ``x`` with the codec named ``codec``: ``(header map for a frame header, payload)``. See
    :meth:`Codec.encode_tensor`."""
    header, payload = get_codec(codec).encode_tensor(x)
    return header.to_dict(), payload


def decode_tensor(
    header: Union[TensorHeader, dict[str, Any]],
    payload: Buffer,
    *,
    shape: Optional[Sequence[int]] = None,
    dtype: Optional[torch.dtype] = None,
    codecs: Sequence[str] = CODECS,
) -> torch.Tensor:
    """Decode a peer's tensor: a fresh, writable CPU tensor of the header's dtype and shape.

    Args:
        header: the :class:`TensorHeader` or its map as received.
        payload: exactly ``encoded_size`` bytes.
        shape, dtype: what the receiver expects (None = accept any).
        codecs: codec names the receiver accepts.

    Raises:
        ProtocolViolation: malformed header, a codec/shape/dtype other than expected, a payload of the wrong size
            (all checked before decoding), invalid codec metadata or non-finite decoded values.
    """
    spec = header if isinstance(header, TensorHeader) else TensorHeader.from_dict(header)
    if spec.codec not in codecs:
        raise ProtocolViolation(f"codec {spec.codec!r} is not one of {tuple(codecs)}")
    if shape is not None and tuple(shape) != spec.shape:
        raise ProtocolViolation(f"tensor of shape {list(spec.shape)}, expected {list(shape)}")
    tdtype = DTYPES[spec.dtype]
    if dtype is not None and dtype != tdtype:
        raise ProtocolViolation(f"tensor of dtype {spec.dtype}, expected {dtype}")
    try:
        flat = get_codec(spec.codec)._decode_checked(payload, spec.numel, tdtype)
    except ValueError as e:
        raise ProtocolViolation(str(e)) from None
    return flat.view(spec.shape)
