"""Codecs that cast every value to a float type: ``none`` (lossless), ``fp16`` and ``bf16``."""

from __future__ import annotations

import torch

from protocols.codecs.base import Buffer, Codec, _bytes_of, _from_bytes, all_finite

_FP16_MAX = 65504.0


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
