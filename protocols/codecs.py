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
- ``"fp4"``: 4-bit floats e2m1 (sign, 2 exponent bits, 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) with
  one fp32 scale ``absmax / 6`` per block of 64 values, as the 4-bit pseudo-gradients of Streaming DiLoCo (Douillard
  et al. 2025, arXiv 2501.18512, section 2.3). Layout: ``ceil(n / 64)`` fp32 scales, then ``ceil(n / 2)`` bytes of
  codes (value ``2i`` in the low nibble, ``2i + 1`` in the high one); ``4 * ceil(n / 64) + ceil(n / 2)`` bytes.
- ``"sign"`` (:data:`PSEUDO_GRADIENT_CODECS`): scaled sign, 1 bit per value: per block of 64 values
  ``scale = mean |x|`` and each value's sign, decoded as ``+-scale`` (the scaled-sign compressor of Karimireddy et
  al. 2019, arXiv 1901.09847, per block as 1-bit SGD quantizes per column, Seide et al. 2014). For DiLoCo
  pseudo-gradients only (too coarse for activations or outer states: not in :data:`CODECS`). Layout:
  ``ceil(n / 64)`` fp32 scales, then ``ceil(n / 8)`` bytes of sign bits (value ``i`` in bit ``i % 8`` of byte
  ``i // 8``, 1 = non-negative; padding bits 0); ``4 * ceil(n / 64) + ceil(n / 8)`` bytes, 1.5 bits per value.
- ``"topk"`` (sparse, :data:`SPARSE_CODECS`): SparseLoCo's compressor (Sarfi et al. 2025, arXiv 2508.15706): per
  chunk of 4096 values the ``ceil(0.02 * chunk)`` largest magnitudes, each sent as a chunk-local uint16 index and a
  2-bit value (sign, and whether it is nearer the chunk's smallest or largest selected magnitude). Lossy by design:
  pair it with :class:`ErrorFeedback` so what is not sent is sent in later rounds. The butterfly all-reduce averages
  it densely (see :mod:`protocols.allreduce`); the sparse all-gather sums the members' vectors as sent
  (:mod:`protocols.allgather`, :meth:`TopKCompression.decode_sparse`). Not in :data:`CODECS`:
  :func:`decode_tensor` accepts it only when asked to.

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
    "CODECS", "DTYPES", "PSEUDO_GRADIENT_CODECS", "SPARSE_CODECS", "Codec", "BFloat16Compression", "ErrorFeedback",
    "Float16Compression", "Fp4Compression", "Int8Compression", "NoCompression", "SignCompression", "TensorHeader",
    "TopKCompression", "all_finite",
    "decode_tensor", "encode_tensor", "get_codec",
]

#: Dense codecs: every value travels (approximately).
CODECS = ("none", "fp16", "bf16", "int8", "fp4")
#: Dense codecs for pseudo-gradients only: too coarse for activations (refused by :func:`decode_tensor` unless asked)
#: or outer states.
PSEUDO_GRADIENT_CODECS = ("sign",)
#: Sparse codecs: only some values travel; the sender keeps the rest in an :class:`ErrorFeedback`.
SPARSE_CODECS = ("topk",)
_ALL_CODECS = CODECS + PSEUDO_GRADIENT_CODECS + SPARSE_CODECS

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
        if codec not in _ALL_CODECS:
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
    """Encodes tensors to bytes and back. Subclasses set ``name`` (one of :data:`CODECS`,
    :data:`PSEUDO_GRADIENT_CODECS` or :data:`SPARSE_CODECS`)."""

    name: str
    sparse: bool = False
    """True if the codec drops values on purpose (a mean of such tensors is not representable in the codec)."""

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


class _BlockwiseCodec(Codec):
    """A codec with one fp32 scale per block of ``block_size`` consecutive values (the last block may be short)."""

    def __init__(self, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size

    def _num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (n,) as fp32 blocks (ceil(n / block_size), block_size), the last one padded with zeros."""
        numel, nblocks = flat.numel(), self._num_blocks(flat.numel())
        padded = torch.zeros(nblocks * self.block_size, dtype=torch.float32)
        padded[:numel] = flat
        return padded.view(nblocks, self.block_size)

    def _scales(self, view: memoryview, numel: int) -> np.ndarray:
        """The ceil(numel / block_size) fp32 scales that open the payload; ValueError unless finite and >= 0."""
        scales = np.frombuffer(view, dtype="<f4", count=self._num_blocks(numel)).astype(np.float32)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError(f"{self.name}: scales must be finite and >= 0")
        return scales


class Int8Compression(_BlockwiseCodec):
    """``"int8"``: blockwise absmax quantization; ``block_size`` values share one fp32 scale (default 256).

    Layout: ``ceil(numel / block_size)`` little-endian fp32 scales ``absmax / 127`` (0 for an all-zero block), then
    ``numel`` int8 values ``round(x / scale)`` (round half to even) in [-127, 127]; the last block may be short.
    Error per value is at most ``scale / 2`` (plus the rounding back to a 16-bit input dtype). The wire name does not
    carry ``block_size``: peers must agree on it.
    """

    name = "int8"

    def __init__(self, block_size: int = 256) -> None:
        super().__init__(block_size)

    def encoded_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 4 * self._num_blocks(numel) + numel

    def _encode_flat(self, flat: torch.Tensor) -> Buffer:
        numel = flat.numel()
        blocks = self._blocks(flat)  # (nblocks, block_size)
        scales = blocks.abs().amax(dim=1) / 127.0  # (nblocks,)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[:numel]
        return scales.numpy().astype("<f4", copy=False).tobytes() + q.numpy().tobytes()

    def _decode_flat(self, view: memoryview, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nblocks = self._num_blocks(numel)
        scales = self._scales(view, numel)
        q = np.frombuffer(view, dtype=np.int8, count=numel, offset=4 * nblocks)
        out = np.zeros(nblocks * self.block_size, dtype=np.float32)
        out[:numel] = q
        out = out.reshape(nblocks, self.block_size)
        out *= scales[:, None]
        flat = out.reshape(-1)[:numel].copy() if nblocks * self.block_size != numel else out.reshape(-1)
        return torch.from_numpy(flat).to(dtype)

    def __repr__(self) -> str:
        return f"Int8Compression(block_size={self.block_size})"


#: e2m1 magnitudes by 3-bit code; bit 3 of a code is the sign.
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
_E2M1_SIGNED = np.concatenate([_E2M1, -_E2M1])  # (16,) value of each 4-bit code
#: Midpoints between neighbouring magnitudes: a value on a midpoint rounds toward zero.
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


class Fp4Compression(_BlockwiseCodec):
    """``"fp4"``: e2m1 4-bit floats with one fp32 scale ``absmax / 6`` per block of ``block_size`` values (default 64).

    Streaming DiLoCo (arXiv 2501.18512) sends its pseudo-gradients as e2m1 4-bit floats. Each value ``x`` of a block
    with scale ``s`` becomes the e2m1 number nearest to ``x / s`` (computed in fp32; a value exactly between two
    neighbours rounds toward zero; zero has no sign); it decodes to ``e2m1 * s`` in fp32, one IEEE multiply, so
    the same bytes give the same bits everywhere. Error per value: at most ``s / 4`` where ``|x| <= 2 s``, ``s / 2``
    where ``|x| <= 4 s`` and ``s`` above (the grid's half-gaps), plus fp32 rounding. Layout: ``ceil(n / block_size)``
    little-endian fp32 scales, then ``ceil(n / 2)`` bytes of codes, value ``2i`` in the low nibble (a trailing
    high nibble is 0). The wire name does not carry ``block_size``: peers must agree on it.
    """

    name = "fp4"

    def __init__(self, block_size: int = 64) -> None:
        super().__init__(block_size)

    def encoded_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 4 * self._num_blocks(numel) + (numel + 1) // 2

    def _encode_flat(self, flat: torch.Tensor) -> Buffer:
        numel = flat.numel()
        blocks = self._blocks(flat)  # (nblocks, block_size)
        scales = blocks.abs().amax(dim=1) / 6.0  # (nblocks,)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        scaled = (blocks / safe[:, None]).view(-1)[:numel]  # (numel,) in [-6, 6] up to rounding
        codes = torch.bucketize(scaled.abs(), _E2M1_MIDPOINTS).to(torch.uint8)  # (numel,) 0..7
        codes |= ((scaled < 0) & (codes > 0)).to(torch.uint8) << 3
        if numel % 2:
            codes = torch.cat([codes, torch.zeros(1, dtype=torch.uint8)])
        packed = codes[0::2] | (codes[1::2] << 4)
        return scales.numpy().astype("<f4", copy=False).tobytes() + packed.numpy().tobytes()

    def _decode_flat(self, view: memoryview, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nblocks = self._num_blocks(numel)
        scales = self._scales(view, numel)
        packed = np.frombuffer(view, dtype=np.uint8, count=(numel + 1) // 2, offset=4 * nblocks)
        if numel % 2 and packed.size and packed[-1] >> 4:
            raise ValueError("fp4: the padding nibble must be 0")
        codes = np.empty(2 * packed.size, dtype=np.uint8)
        codes[0::2], codes[1::2] = packed & 0x0F, packed >> 4
        out = np.zeros(nblocks * self.block_size, dtype=np.float32)
        out[:numel] = _E2M1_SIGNED[codes[:numel]]
        out = out.reshape(nblocks, self.block_size)
        with np.errstate(over="ignore"):  # a huge scale overflows to inf: refused by the finite check after decoding
            out *= scales[:, None]
        return torch.from_numpy(out.reshape(-1)[:numel].copy()).to(dtype)

    def __repr__(self) -> str:
        return f"Fp4Compression(block_size={self.block_size})"


class SignCompression(_BlockwiseCodec):
    """``"sign"``: scaled sign, 1 bit per value plus one fp32 scale ``mean |x|`` per block of ``block_size`` values
    (default 64: 1.5 bits per value, 10.7x fewer bytes than fp16); ``mean |x|`` is the scale that minimizes the
    block's squared error for its sign pattern.

    The scaled-sign compressor of Karimireddy et al. 2019 (arXiv 1901.09847), per block. Used *without* error
    feedback: on DiLoCo pseudo-gradients (``scripts/bench_outer_codecs.py``, 4 peers, tiny model) pseudo-gradients
    and answers in this codec ended 0.1% (150 steps, H = 10) and 1.5% (300 steps, H = 30) above fp16's eval loss,
    while keeping the unsent rest in an :class:`ErrorFeedback` ended 2.7% and 3.0% above (the residual arrives a
    round late, against a moved model, on top of the outer Nesterov momentum); blocks of 256 values were worse; on
    the 10.7M-parameter model at H = 50 it ended 0.55% above after 6 outer rounds, and after 3 rounds 3.5% above
    with DiLoCo's outer lr 0.7 but 0.85% above with 1.0 (the average of signs is shorter than fp16's; fp16 itself is
    worse at 1.0; ``docs/benchmarks.md``). A value decodes to ``+scale`` (bit 1: the value was >= 0) or ``-scale``,
    no arithmetic beyond the sign, so the same bytes give the same bits everywhere. Layout (little-endian):
    ``ceil(n / block_size)`` fp32 scales, then ``ceil(n / 8)`` bytes of bits (value ``i`` in bit ``i % 8`` of byte
    ``i // 8``; padding bits 0). The wire name does not carry ``block_size``: peers must agree on it.
    """

    name = "sign"

    def __init__(self, block_size: int = 64) -> None:
        super().__init__(block_size)

    def encoded_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 4 * self._num_blocks(numel) + (numel + 7) // 8

    def _encode_flat(self, flat: torch.Tensor) -> Buffer:
        numel = flat.numel()
        blocks = self._blocks(flat)  # (nblocks, block_size)
        counts = torch.full((blocks.shape[0],), float(self.block_size))
        if blocks.shape[0]:
            counts[-1] = numel - (blocks.shape[0] - 1) * self.block_size
        scales = blocks.abs().sum(dim=1) / counts  # (nblocks,) mean |x|
        bits = np.packbits((flat >= 0).numpy(), bitorder="little")
        return scales.numpy().astype("<f4", copy=False).tobytes() + bits.tobytes()

    def _decode_flat(self, view: memoryview, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nblocks = self._num_blocks(numel)
        scales = self._scales(view, numel)
        packed = np.frombuffer(view, dtype=np.uint8, count=(numel + 7) // 8, offset=4 * nblocks)
        if numel % 8 and packed.size and packed[-1] >> (numel % 8):
            raise ValueError("sign: the padding bits must be 0")
        out = np.zeros(nblocks * self.block_size, dtype=np.float32)
        out[:numel] = np.unpackbits(packed, count=numel, bitorder="little")
        out[:numel] *= 2.0
        out[:numel] -= 1.0  # +-1 exactly
        out = out.reshape(nblocks, self.block_size)
        out *= scales[:, None]
        return torch.from_numpy(out.reshape(-1)[:numel].copy()).to(dtype)

    def __repr__(self) -> str:
        return f"SignCompression(block_size={self.block_size})"


class TopKCompression(Codec):
    """``"topk"``: SparseLoCo's top-k + 2-bit compressor (Sarfi et al. 2025, arXiv 2508.15706, section 3).

    The values are cut into chunks of ``chunk_size`` (default 4096; the last may be short). From a chunk of ``m``
    values the ``k = ceil(fraction * m)`` largest magnitudes are kept (default fraction 0.02; ties broken by the lower
    index, so the choice is deterministic), with ``lo`` / ``hi`` the smallest / largest kept magnitude. A kept value
    travels as its chunk-local index (uint16) and 2 bits: bit 0 = its magnitude is nearer ``hi`` than ``lo`` (a tie
    goes to ``lo``), bit 1 = negative; it decodes to ``+-lo`` or ``+-hi`` (so the error on a kept value is at most
    ``(hi - lo) / 2``); every other value decodes to 0.

    Layout (little-endian): per chunk ``lo, hi`` as fp32 (``8 * n_chunks`` bytes), then all chunks' indices as uint16,
    ascending within a chunk (``2 K`` bytes, ``K`` = total kept), then the 2-bit codes, four per byte from the low
    bits up, unused bits 0 (``ceil(K / 4)`` bytes). The size depends only on ``n``, so it is exact before decoding.
    A decoder refuses non-finite or negative magnitudes, ``lo > hi``, indices out of the chunk or not strictly
    increasing, and non-zero padding bits. Peers must agree on ``fraction`` and ``chunk_size``.
    """

    name = "topk"
    sparse = True

    def __init__(self, fraction: float = 0.02, chunk_size: int = 4096) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= 65536:
            raise ValueError(f"chunk_size must be an int in [1, 65536], got {chunk_size!r}")
        self.fraction, self.chunk_size = float(fraction), chunk_size

    def _chunks(self, numel: int) -> list[tuple[int, int, int]]:
        """(start, length, k) per chunk; full chunks first, then a short last one."""
        out = []
        for start in range(0, numel, self.chunk_size):
            m = min(self.chunk_size, numel - start)
            out.append((start, m, min(m, math.ceil(self.fraction * m))))
        return out

    def kept(self, numel: int) -> int:
        """K, how many of ``numel`` values travel."""
        return sum(k for _, _, k in self._chunks(numel))

    def encoded_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        nchunks, kept = -(-numel // self.chunk_size), self.kept(numel)
        return 8 * nchunks + 2 * kept + (kept + 3) // 4

    def _select(self, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows (c, m) fp32 -> ascending kept indices (c, k) uint16, magnitudes (lo, hi) (c,) and 2-bit codes (c, k)."""
        order = np.argsort(-np.abs(rows), axis=1, kind="stable")[:, :k]
        idx = np.sort(order, axis=1)
        vals = np.take_along_axis(rows, idx, axis=1)
        mags = np.abs(vals)
        lo, hi = mags.min(axis=1), mags.max(axis=1)
        nearer_hi = (hi[:, None] - mags) < (mags - lo[:, None])
        codes = nearer_hi.astype(np.uint8) | ((vals < 0).astype(np.uint8) << 1)
        return idx.astype("<u2"), np.stack([lo, hi], axis=1), codes

    def _encode_flat(self, flat: torch.Tensor) -> Buffer:
        x = flat.to(torch.float32).numpy()
        numel, c = x.size, self.chunk_size
        full = numel // c
        parts = []
        if full:
            parts.append(self._select(x[: full * c].reshape(full, c), self._chunks(c)[0][2]))
        if numel % c:
            tail = x[full * c:].reshape(1, -1)
            parts.append(self._select(tail, self._chunks(tail.size)[0][2]))
        if not parts:
            return b""
        scales = np.concatenate([p[1].reshape(-1) for p in parts]).astype("<f4")
        idx = np.concatenate([p[0].reshape(-1) for p in parts])
        codes = np.concatenate([p[2].reshape(-1) for p in parts])
        codes = np.concatenate([codes, np.zeros(-codes.size % 4, dtype=np.uint8)]).reshape(-1, 4)
        packed = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)
        return scales.tobytes() + idx.tobytes() + packed.astype(np.uint8).tobytes()

    def decode_sparse(self, buf: Buffer, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode untrusted ``buf`` (``numel`` values encoded) without densifying: ``(positions, values)``, int64
        (K,) strictly increasing positions in [0, numel) and their fp32 (K,) values (``K`` = :meth:`kept`; a value
        may be 0 where a chunk's magnitudes are 0). Raises ValueError on a wrong size or invalid metadata, as
        :meth:`decode`."""
        if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 0:
            raise ValueError(f"numel must be an int >= 0, got {numel!r}")
        try:
            view = memoryview(buf).cast("B")
        except TypeError as e:
            raise ValueError(f"buffer must be bytes-like and contiguous: {e}") from None
        if view.nbytes != self.encoded_size(int(numel)):
            raise ValueError(f"topk: expected {self.encoded_size(int(numel))} bytes for {numel} values, "
                             f"got {view.nbytes}")
        positions, values = self._sparse(view, int(numel))
        return torch.from_numpy(positions), torch.from_numpy(values)

    def _sparse(self, view: memoryview, numel: int) -> tuple[np.ndarray, np.ndarray]:
        """Validated positions (int64, ascending) and fp32 values of a buffer of the exact size."""
        chunks = self._chunks(numel)
        kept = sum(k for _, _, k in chunks)
        scales = np.frombuffer(view, dtype="<f4", count=2 * len(chunks)).astype(np.float32).reshape(-1, 2)
        if not (np.isfinite(scales).all() and (scales >= 0).all() and (scales[:, 0] <= scales[:, 1]).all()):
            raise ValueError("topk: magnitudes must be finite, >= 0 and lo <= hi")
        idx = np.frombuffer(view, dtype="<u2", count=kept, offset=8 * len(chunks)).astype(np.int64)
        packed = np.frombuffer(view, dtype=np.uint8, offset=8 * len(chunks) + 2 * kept)
        codes = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)
        if codes[kept:].any():
            raise ValueError("topk: padding bits must be 0")
        codes = codes[:kept]
        lengths = np.repeat([m for _, m, _ in chunks], [k for _, _, k in chunks])
        starts = np.repeat([s for s, _, _ in chunks], [k for _, _, k in chunks])
        chunk_of = np.repeat(np.arange(len(chunks)), [k for _, _, k in chunks])
        if (idx >= lengths).any():
            raise ValueError("topk: index beyond its chunk")
        same_chunk = chunk_of[1:] == chunk_of[:-1]
        if (same_chunk & (idx[1:] <= idx[:-1])).any():
            raise ValueError("topk: indices within a chunk must be strictly increasing")
        mags = scales[chunk_of, (codes & 1).astype(np.int64)]
        return (starts + idx).astype(np.int64), np.where(codes & 2, -mags, mags).astype(np.float32)

    def _decode_flat(self, view: memoryview, numel: int, dtype: torch.dtype) -> torch.Tensor:
        positions, values = self._sparse(view, numel)
        out = np.zeros(numel, dtype=np.float32)
        out[positions] = values
        return torch.from_numpy(out).to(dtype)

    def __repr__(self) -> str:
        return f"TopKCompression(fraction={self.fraction}, chunk_size={self.chunk_size})"


class ErrorFeedback:
    """The part of a sparse codec's input that was not sent, kept locally and added to the next round's input.

    SparseLoCo (arXiv 2508.15706, Algorithm 1): ``e <- decay * e + delta``; send ``C(e)``; ``e <- e - decode(C(e))``.
    :meth:`compensate` gives the vector to send (``decay * e + delta``, fp32 (P,)); after the all-reduce,
    :meth:`record` keeps ``compensated - sent`` where ``sent`` is what the codec actually delivered (the all-reduce
    reports it: :attr:`protocols.allreduce.AllReduceResult.sent`). With ``decay = 1`` nothing is ever lost: the sum of
    everything sent plus :attr:`error` equals the sum of the deltas. The state is this peer's alone (never sent).
    """

    def __init__(self, numel: int, decay: float = 1.0) -> None:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be an int >= 0, got {numel!r}")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay!r}")
        self.decay = float(decay)
        self.error = torch.zeros(numel, dtype=torch.float32)  # (P,)

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        """A new fp32 (P,) tensor ``decay * error + delta``; the state is unchanged. ValueError on a wrong shape."""
        if not isinstance(delta, torch.Tensor) or delta.shape != self.error.shape:
            raise ValueError(f"delta must have shape {tuple(self.error.shape)}")
        out = self.error * self.decay if self.decay != 1.0 else self.error.clone()
        return out.add_(delta.detach().to("cpu", torch.float32))

    def record(self, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep ``compensated - sent`` (both fp32 (P,)) as the error. ValueError on a wrong shape (state unchanged)."""
        for name, t in (("compensated", compensated), ("sent", sent)):
            if not isinstance(t, torch.Tensor) or t.shape != self.error.shape:
                raise ValueError(f"{name} must have shape {tuple(self.error.shape)}")
        self.error = compensated.detach().to("cpu", torch.float32) - sent.detach().to("cpu", torch.float32)

    def send(self, delta: torch.Tensor, codec: Codec) -> bytes:
        """Compensate ``delta``, encode it with ``codec`` (1-D fp32 interface), record what the bytes decode to."""
        compensated = self.compensate(delta)
        payload = codec.encode(compensated)
        self.record(compensated, codec.decode(payload, compensated.numel()))
        return payload


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
