"""Tensor codecs for the wire: N-D fp32 / bf16 / fp16 tensors to bytes and back, with dtype and shape; pure, no I/O.

Used by averaging (DiLoCo pseudo-gradients, 1-D fp32) and by pipeline activations and gradients ((B, T, C) bf16 or
fp16). Every codec is deterministic on both sides: the same tensor gives the same bytes, and the same bytes decode to
the same bits on every peer (no threads, no fused kernels, IEEE conversions only), which is what lets an all-reduce
reducer send one encoded mean that every member decodes bit-identically.

An encoded tensor is a :class:`TensorHeader` (codec, dtype, shape: a msgpack-able map that travels in a frame
header) plus a payload of exactly :meth:`Codec.encoded_size` bytes. Peer input is untrusted: :func:`decode_tensor`
checks the header (known codec and dtype, sane shape), the shape/dtype the receiver expects and the exact payload
size *before* decoding, then that every decoded value is finite; any failure is a
:class:`protocols.wire.ProtocolViolation` (the caller excludes that peer).

Codecs (little-endian; ``n`` = number of values):

- ``"none"``: raw values in the tensor's own dtype (4 bytes per fp32 value, 2 per bf16/fp16); lossless.
- ``"fp16"``: IEEE half, 2 bytes per value; values saturate at +-65504 instead of overflowing to inf. OpenDiLoCo
  (arXiv 2407.07852) found no loss penalty from fp16 pseudo-gradients.
- ``"bf16"``: bfloat16 (round to nearest even), 2 bytes per value; fp32's range, 8 bits of mantissa.
- ``"int8"``: blockwise absmax quantization (as in INTELLECT-1's 8-bit pseudo-gradients, here signed and
  symmetric): per block of 256 values ``scale = absmax / 127`` and ``q = round(x / scale)`` in [-127, 127], computed
  in fp32. Layout: ``ceil(n / 256)`` fp32 scales, then ``n`` int8 values; ``n + 4 * ceil(n / 256)`` bytes.

A decoded tensor has the dtype and shape of the encoded one (a lossy codec's values converted back to that dtype).
The 1-D fp32 interface of earlier releases (:meth:`Codec.encode` / :meth:`Codec.decode` with ``numel``, raising
ValueError) is kept for averaging.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from protocols.wire import ProtocolViolation

__all__ = [
    "CODECS", "DTYPES", "Codec", "BFloat16Compression", "Float16Compression", "Int8Compression", "NoCompression",
    "TensorHeader", "all_finite", "decode_tensor", "encode_tensor", "get_codec",
]

CODECS = ("none", "fp16", "bf16", "int8")

#: Dtypes a tensor codec accepts, by wire name.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

#: Largest rank and element count a peer may announce (2**40 values: far above any tensor we send).
MAX_NDIM = 8
MAX_NUMEL = 2**40

_FP16_MAX = 65504.0

Buffer = Union[bytes, bytearray, memoryview]


def all_finite(x: torch.Tensor | np.ndarray) -> bool:
    """True if every value of ``x`` (a CPU tensor or array of floats, any shape; bf16 included) is finite.

    Fast path: a sum that is finite proves every term finite (NaN and inf propagate); only when the sum is not
    (NaN/inf present, or finite values overflowing) are the values checked one by one. About 10x cheaper than
    ``torch.isfinite(x).all()``, which materializes a boolean tensor.
    """
    if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
        bits = x.detach().contiguous().view(torch.int16).numpy()
        return bool(((bits & 0x7F80) != 0x7F80).all())  # exponent all ones: inf or NaN
    arr = x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if arr.size == 0:
        return True
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(arr.sum()):
            return True
    return bool(np.isfinite(arr).all())


@dataclass(frozen=True)
class TensorHeader:
    """What travels beside an encoded payload: codec name, dtype name (a key of :data:`DTYPES`) and shape."""

    codec: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-able map: ``{"codec", "dtype", "shape": [ints]}``."""
        return {"codec": self.codec, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, value: Any) -> "TensorHeader":
        """Parse and validate a peer's header. Raises ProtocolViolation on an unknown codec or dtype, or a shape
        that is not a list of at most MAX_NDIM non-negative ints with at most MAX_NUMEL elements."""
        if not isinstance(value, dict):
            raise ProtocolViolation(f"tensor header must be a map, got {type(value).__name__}")
        codec, dtype, shape = value.get("codec"), value.get("dtype"), value.get("shape")
        if codec not in CODECS:
            raise ProtocolViolation(f"unknown codec {codec!r}")
        if dtype not in DTYPES:
            raise ProtocolViolation(f"unsupported dtype {dtype!r}")
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise ProtocolViolation(f"malformed shape {shape!r}")
        if math.prod(shape) > MAX_NUMEL:
            raise ProtocolViolation(f"shape {shape} has more than {MAX_NUMEL} elements")
        return cls(codec, dtype, tuple(shape))


def _check_tensor(x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPE_NAMES or x.device.type != "cpu":
        raise ValueError(f"expected a float32/bfloat16/float16 CPU tensor, got {x.dtype} on {x.device}")
    if not all_finite(x):
        raise ValueError("cannot encode non-finite values")


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _from_bytes(view: memoryview, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A fresh, writable (numel,) tensor of ``dtype`` holding the first bytes of ``view`` (one copy)."""
    out = torch.empty(numel, dtype=dtype)
    if numel:
        out.view(torch.uint8).numpy()[:] = np.frombuffer(view, dtype=np.uint8, count=numel * dtype.itemsize)
    return out


class Codec(abc.ABC):
    """Encodes tensors to bytes and back. Subclasses set ``name`` (one of :data:`CODECS`)."""

    name: str

    @abc.abstractmethod
    def encoded_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact number of payload bytes for ``numel`` values of input ``dtype``."""

    @abc.abstractmethod
    def _encode_flat(self, flat: torch.Tensor) -> Buffer:
        """Encode a contiguous finite (n,) tensor of a supported dtype."""

    @abc.abstractmethod
    def _decode_flat(self, view: memoryview, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Decode ``numel`` values of ``dtype`` from a buffer of exactly the encoded size; fresh and writable.
        Raises ValueError on invalid codec metadata."""

    # N-D interface

    def encode_tensor(self, x: torch.Tensor) -> tuple[TensorHeader, Buffer]:
        """Encode ``x`` (any shape; float32, bfloat16 or float16; finite; CPU) -> ``(header, payload)``.

        The payload may be a view of ``x``'s memory (codec ``none``): do not modify ``x`` until it is sent.
        Raises ValueError on unsupported or non-finite input.
        """
        _check_tensor(x)
        payload = self._encode_flat(x.detach().contiguous().reshape(-1))
        return TensorHeader(self.name, _DTYPE_NAMES[x.dtype], tuple(x.shape)), payload

    # 1-D fp32 interface (averaging)

    def encode(self, x: torch.Tensor) -> bytes:
        """Encode ``x``: finite fp32 (numel,) on CPU. Deterministic: same input, same bytes.

        Raises ``ValueError`` if ``x`` is not a finite 1-D float32 CPU tensor.
        """
        if isinstance(x, torch.Tensor) and (x.dtype != torch.float32 or x.dim() != 1):
            raise ValueError(f"expected a 1-D float32 CPU tensor, got {x.dtype} {tuple(x.shape)}")
        _check_tensor(x)
        out = self._encode_flat(x.contiguous())
        return out if isinstance(out, bytes) else bytes(out)

    def decode(self, buf: Buffer, numel: int) -> torch.Tensor:
        """Decode ``numel`` fp32 values from untrusted ``buf`` into a fresh writable (numel,) CPU tensor.

        Raises ``ValueError`` if ``len(buf) != encoded_size(numel)``, the codec's metadata is invalid (int8: a
        scale that is negative or non-finite), or a decoded value is non-finite.
        """
        if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 0:
            raise ValueError(f"numel must be an int >= 0, got {numel!r}")
        return self._decode_checked(buf, int(numel), torch.float32)

    def _decode_checked(self, buf: Buffer, numel: int, dtype: torch.dtype) -> torch.Tensor:
        try:
            view = memoryview(buf).cast("B")
        except TypeError as e:
            raise ValueError(f"buffer must be bytes-like and contiguous: {e}") from None
        expected = self.encoded_size(numel, dtype)
        if view.nbytes != expected:
            raise ValueError(f"{self.name}: expected {expected} bytes for {numel} values, got {view.nbytes}")
        out = self._decode_flat(view, numel, dtype)
        if not all_finite(out):
            raise ValueError(f"{self.name}: decoded values are not all finite")
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoCompression(Codec):
    """``"none"``: raw little-endian values in the input dtype; lossless."""

    name = "none"

    def encoded_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return dtype.itemsize * numel

    def _encode_flat(self, flat: torch.Tensor) -> Buffer:
        return _bytes_of(flat)

    def _decode_flat(self, view: memoryview, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return _from_bytes(view, dtype, numel)


class Float16Compression(Codec):
    """``"fp16"``: little-endian IEEE half, 2 bytes per value; relative error <= 2**-11 within the normal range.

    Values are clamped to [-65504, 65504] before the cast so they saturate rather than become inf.
    """

    name = "fp16"

    def encoded_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 2 * numel

    def _encode_flat(self, flat: torch.Tensor) -> Buffer:
        if flat.dtype == torch.float16:
            return _bytes_of(flat)
        return _bytes_of(flat.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16))

    def _decode_flat(self, view: memoryview, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return _from_bytes(view, torch.float16, numel).to(dtype)


class BFloat16Compression(Codec):
    """``"bf16"``: bfloat16 (round to nearest even), 2 bytes per value; relative error <= 2**-8."""

    name = "bf16"

    def encoded_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 2 * numel

    def _encode_flat(self, flat: torch.Tensor) -> Buffer:
        if flat.dtype != torch.bfloat16:  # fp16 -> bf16 can overflow nothing (bf16 has fp32's range)
            flat = flat.to(torch.bfloat16)
            if not all_finite(flat):  # fp32 values above bf16's max round to inf
                raise ValueError("bf16: values beyond bfloat16's range")
        return _bytes_of(flat)

    def _decode_flat(self, view: memoryview, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return _from_bytes(view, torch.bfloat16, numel).to(dtype)


class Int8Compression(Codec):
    """``"int8"``: blockwise absmax quantization; ``block_size`` values share one fp32 scale (default 256).

    Layout: ``ceil(numel / block_size)`` little-endian fp32 scales ``absmax / 127`` (0 for an all-zero block), then
    ``numel`` int8 values ``round(x / scale)`` (round half to even) in [-127, 127]; the last block may be short.
    Error per value is at most ``scale / 2`` (plus the rounding back to a 16-bit input dtype). The wire name does not
    carry ``block_size``: peers must agree on it.
    """

    name = "int8"

    def __init__(self, block_size: int = 256) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size

    def _num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def encoded_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 4 * self._num_blocks(numel) + numel

    def _encode_flat(self, flat: torch.Tensor) -> Buffer:
        numel, nblocks = flat.numel(), self._num_blocks(flat.numel())
        padded = torch.zeros(nblocks * self.block_size, dtype=torch.float32)
        padded[:numel] = flat
        blocks = padded.view(nblocks, self.block_size)  # (nblocks, block_size)
        scales = blocks.abs().amax(dim=1) / 127.0  # (nblocks,)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[:numel]
        return scales.numpy().astype("<f4", copy=False).tobytes() + q.numpy().tobytes()

    def _decode_flat(self, view: memoryview, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nblocks = self._num_blocks(numel)
        scales = np.frombuffer(view, dtype="<f4", count=nblocks).astype(np.float32)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError("int8: scales must be finite and >= 0")
        q = np.frombuffer(view, dtype=np.int8, count=numel, offset=4 * nblocks)
        out = np.zeros(nblocks * self.block_size, dtype=np.float32)
        out[:numel] = q
        out = out.reshape(nblocks, self.block_size)
        out *= scales[:, None]
        flat = out.reshape(-1)[:numel].copy() if nblocks * self.block_size != numel else out.reshape(-1)
        return torch.from_numpy(flat).to(dtype)

    def __repr__(self) -> str:
        return f"Int8Compression(block_size={self.block_size})"


_CODEC_TYPES = {"none": NoCompression, "fp16": Float16Compression, "bf16": BFloat16Compression,
                "int8": Int8Compression}


def get_codec(name: str) -> Codec:
    """A codec by wire name (one of :data:`CODECS`), with default parameters. Raises ``ValueError`` otherwise."""
    if name not in _CODEC_TYPES:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(CODECS)}")
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
