"""The wire format of a part's chunks: encode a fp32 chunk, decode an untrusted one (checked finite), with fast
paths for the raw codecs ``none`` and ``fp16`` (views, no copy). No I/O."""

from __future__ import annotations

import warnings
from typing import Union

import numpy as np
import torch

from protocols.codecs import Codec, all_finite


def _readonly_view(buf: Union[bytes, bytearray, memoryview], dtype: str) -> torch.Tensor:
    """A tensor over ``buf``'s memory, no copy; never written (torch warns about read-only buffers, harmlessly)."""
    array = np.frombuffer(buf, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


_RAW_DTYPES = {"none": "<f4", "fp16": "<f2"}


def decode_chunk(codec: Codec, buf: Union[bytes, bytearray, memoryview], numel: int) -> torch.Tensor:
    """Decode ``numel`` values of an untrusted chunk, checked finite; for codecs ``none`` and ``fp16`` a read-only
    view of ``buf`` (fp32 or fp16: no copy, no conversion pass; fp16 -> fp32 is exact wherever it is added), else
    fp32. Raises ValueError on a wrong size or non-finite values."""
    raw = _RAW_DTYPES.get(codec.name)
    if raw is None:
        return codec.decode(buf, numel)
    if len(memoryview(buf).cast("B")) != codec.encoded_size(numel):
        raise ValueError(f"{codec.name}: expected {codec.encoded_size(numel)} bytes for {numel} values, got {len(buf)}")
    values = _readonly_view(buf, raw)
    if not all_finite(values):
        raise ValueError(f"{codec.name}: decoded values are not all finite")
    return values


def decode_chunk_into(codec: Codec, buf: Union[bytes, bytearray, memoryview], out: torch.Tensor,
                      trusted: bool = False) -> None:
    """Decode an untrusted chunk straight into ``out`` (fp32, its length); ValueError as :func:`decode_chunk`.
    ``trusted``: ``buf`` holds values this peer already checked finite (its own aggregate, codec ``none``), so the
    finiteness pass is skipped."""
    raw = _RAW_DTYPES.get(codec.name)
    if raw is None:
        out.copy_(codec.decode(buf, out.numel()))
        return
    if len(memoryview(buf).cast("B")) != codec.encoded_size(out.numel()):
        raise ValueError(f"{codec.name}: expected {codec.encoded_size(out.numel())} bytes, got {len(buf)}")
    out.copy_(_readonly_view(buf, raw))
    if not trusted and not all_finite(out):
        raise ValueError(f"{codec.name}: decoded values are not all finite")


def encode_chunk(codec: Codec, chunk: torch.Tensor, checked: bool = False) -> Union[bytes, memoryview]:
    """Encode a fp32 chunk; for codec ``none`` a view of its memory (no copy: keep it unmodified until sent).
    ``checked``: the caller already checked every value finite (e.g. once for the whole vector), so the codec's
    own per-call check is skipped. Raises ValueError on non-finite values otherwise."""
    if checked:
        return codec._encode_flat(chunk.contiguous())
    return codec.encode_tensor(chunk)[1]
