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

The package, one family a module: :mod:`~protocols.codecs.base` (the :class:`Codec` interface, the wire names,
dtypes and :class:`TensorHeader`), :mod:`~protocols.codecs.floats` (``none``, ``fp16``, ``bf16``),
:mod:`~protocols.codecs.quantizers` (``int8``, ``fp4``), :mod:`~protocols.codecs.sign` (``sign``),
:mod:`~protocols.codecs.sparse` (``topk`` and :class:`ErrorFeedback`) and :mod:`~protocols.codecs.registry` (a codec
by wire name, :func:`encode_tensor`, :func:`decode_tensor`).
"""

from protocols.codecs.base import (
    CODECS, DTYPES, MAX_NDIM, MAX_NUMEL, PSEUDO_GRADIENT_CODECS, SPARSE_CODECS, Buffer, Codec, TensorHeader, all_finite,
)
from protocols.codecs.floats import BFloat16Compression, Float16Compression, NoCompression
from protocols.codecs.quantizers import Fp4Compression, Int8Compression
from protocols.codecs.registry import decode_tensor, encode_tensor, get_codec
from protocols.codecs.sign import SignCompression
from protocols.codecs.sparse import ErrorFeedback, TopKCompression

__all__ = [
    "CODECS", "DTYPES", "MAX_NDIM", "MAX_NUMEL", "PSEUDO_GRADIENT_CODECS", "SPARSE_CODECS", "Buffer", "Codec", "BFloat16Compression", "ErrorFeedback",
    "Float16Compression", "Fp4Compression", "Int8Compression", "NoCompression", "SignCompression", "TensorHeader",
    "TopKCompression", "all_finite",
    "decode_tensor", "encode_tensor", "get_codec",
]
