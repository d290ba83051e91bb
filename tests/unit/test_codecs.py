"""N-D tensor codecs (protocols.codecs): round trips per codec and dtype, exact sizes, determinism, bad input."""

import math

import numpy as np
import pytest
import torch

from protocols.codecs import CODECS, DTYPES, TensorHeader, decode_tensor, encode_tensor, get_codec
from protocols.wire import ProtocolViolation

pytestmark = pytest.mark.timeout(60)

SHAPES = [(0,), (7,), (3, 5), (2, 3, 300), (2, 1, 4, 65)]
#: Largest relative error (norm) per codec and input dtype.
BOUNDS = {"none": 0.0, "fp16": 1e-3, "bf16": 5e-3, "int8": 2e-2, "fp4": 0.15}


def _tensor(shape, dtype, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()))
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_keeps_dtype_and_shape(codec, dtype, shape):
    x = _tensor(shape, dtype)
    header, payload = encode_tensor(x, codec)
    assert header == {"codec": codec, "dtype": str(dtype).removeprefix("torch."), "shape": list(shape)}
    assert memoryview(payload).nbytes == get_codec(codec).encoded_size(x.numel(), dtype)
    y = decode_tensor(header, payload, shape=shape, dtype=dtype)
    assert y.dtype == dtype and tuple(y.shape) == shape
    y.mul_(1)  # fresh and writable (an exact no-op on the values)
    if x.numel():
        error = float((y.float() - x.float()).norm() / x.float().norm())
        bound = BOUNDS[codec] + (8e-3 if dtype != torch.float32 and codec in ("int8", "fp16", "bf16") else 0.0)
        assert error <= bound, error
    if codec == "none" or (codec == "fp16" and dtype == torch.float16) or (codec == "bf16" and dtype == torch.bfloat16):
        assert torch.equal(y, x)  # lossless for these


@pytest.mark.parametrize("codec, dtype, itemsize", [("none", torch.float32, 4), ("none", torch.bfloat16, 2),
                                                    ("none", torch.float16, 2), ("fp16", torch.float32, 2),
                                                    ("bf16", torch.float32, 2), ("bf16", torch.float16, 2)])
@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 1000])
def test_encoded_sizes_are_exact(codec, dtype, itemsize, numel):
    x = _tensor((numel,), dtype, numel)
    _, payload = encode_tensor(x, codec)
    assert memoryview(payload).nbytes == itemsize * numel == get_codec(codec).encoded_size(numel, dtype)


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 1000])
def test_int8_size_is_values_plus_one_scale_per_block(dtype, numel):
    _, payload = encode_tensor(_tensor((numel,), dtype, numel), "int8")
    assert memoryview(payload).nbytes == numel + 4 * math.ceil(numel / 256)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_same_bytes_decode_to_the_same_bits(codec, dtype):
    x = _tensor((4, 33, 17), dtype, 5)
    header, payload = encode_tensor(x, codec)
    again_header, again = encode_tensor(x.clone(), codec)
    assert bytes(payload) == bytes(again) and header == again_header
    a, b = decode_tensor(header, bytes(payload)), decode_tensor(header, bytearray(payload))
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_strided_input_is_encoded_as_its_values():
    base = _tensor((8, 6), torch.float32)
    x = base.t()  # not contiguous
    header, payload = encode_tensor(x, "none")
    assert torch.equal(decode_tensor(header, payload), x)


def test_fp16_saturates_and_bf16_keeps_the_fp32_range():
    x = torch.tensor([[1e6, -1e6], [1e30, 1.0]])
    h16, p16 = encode_tensor(x, "fp16")
    assert decode_tensor(h16, p16).tolist() == [[65504.0, -65504.0], [65504.0, 1.0]]
    hb, pb = encode_tensor(x, "bf16")
    assert float(decode_tensor(hb, pb)[1, 0]) == pytest.approx(1e30, rel=1e-2)


@pytest.mark.parametrize("bad", [torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.int64),
                                 torch.tensor([1.0, float("nan")]), torch.tensor([[float("inf")]]).to(torch.bfloat16),
                                 [1.0]])
@pytest.mark.parametrize("codec", CODECS)
def test_encode_refuses_bad_input(codec, bad):
    with pytest.raises(ValueError):
        encode_tensor(bad, codec)


def _valid(codec="none", dtype=torch.float32, shape=(2, 3)):
    header, payload = encode_tensor(_tensor(shape, dtype), codec)
    return header, bytes(payload)


@pytest.mark.parametrize("header", [
    None, [], {"codec": "zstd", "dtype": "float32", "shape": [2, 3]}, {"codec": "none", "dtype": "float64", "shape": [2, 3]},
    {"codec": "none", "dtype": "float32", "shape": "2x3"}, {"codec": "none", "dtype": "float32", "shape": [2, -3]},
    {"codec": "none", "dtype": "float32", "shape": [2, True]}, {"codec": "none", "dtype": "float32", "shape": [1] * 9},
    {"codec": "none", "dtype": "float32", "shape": [2**21, 2**21]},
])
def test_malformed_headers_are_violations(header):
    _, payload = _valid()
    with pytest.raises(ProtocolViolation):
        decode_tensor(header, payload)


@pytest.mark.parametrize("codec", CODECS)
def test_a_payload_of_the_wrong_size_is_a_violation(codec):
    header, payload = _valid(codec)
    for bad in (payload[:-1], payload + b"\0", b""):
        with pytest.raises(ProtocolViolation):
            decode_tensor(header, bad)
    with pytest.raises(ProtocolViolation):  # a header that lies about the shape
        decode_tensor({**header, "shape": [3, 3]}, payload)


def test_unexpected_shape_dtype_or_codec_is_a_violation():
    header, payload = _valid("none", torch.float16)
    with pytest.raises(ProtocolViolation, match="shape"):
        decode_tensor(header, payload, shape=(3, 2))
    with pytest.raises(ProtocolViolation, match="dtype"):
        decode_tensor(header, payload, dtype=torch.bfloat16)
    with pytest.raises(ProtocolViolation, match="codec"):
        decode_tensor(header, payload, codecs=("int8",))
    assert decode_tensor(TensorHeader.from_dict(header), payload, shape=[2, 3]).dtype == torch.float16


@pytest.mark.parametrize("codec, dtype, np_dtype", [("none", torch.float32, "<f4"), ("none", torch.float16, "<f2"),
                                                    ("fp16", torch.float32, "<f2")])
def test_non_finite_values_on_the_wire_are_a_violation(codec, dtype, np_dtype):
    header = {"codec": codec, "dtype": str(dtype).removeprefix("torch."), "shape": [2]}
    with pytest.raises(ProtocolViolation, match="finite"):
        decode_tensor(header, np.array([1.0, np.nan], dtype=np_dtype).tobytes())


def test_non_finite_bf16_and_bad_int8_scales_are_violations():
    bf16_nan = torch.tensor([1.0, float("nan")]).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    with pytest.raises(ProtocolViolation, match="finite"):
        decode_tensor({"codec": "bf16", "dtype": "bfloat16", "shape": [2]}, bf16_nan)
    header, payload = _valid("int8", torch.bfloat16, (300,))
    bad = bytearray(payload)
    bad[4:8] = np.array([-1.0], dtype="<f4").tobytes()
    with pytest.raises(ProtocolViolation, match="scale"):
        decode_tensor(header, bytes(bad))
