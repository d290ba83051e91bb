"""Blockwise quantizers: ``int8`` (absmax) and ``fp4`` (e2m1 floats), one fp32 scale per block."""

from __future__ import annotations

import numpy as np
import torch

from protocols.codecs.base import Buffer, _BlockwiseCodec


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
