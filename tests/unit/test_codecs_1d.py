import numpy as np
import pytest
import torch

from protocols.codecs import (
    CODECS,
    Float16Compression,
    Int8Compression,
    NoCompression,
    get_codec,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def gaussian():
    return torch.randn(1_000_000, generator=torch.Generator().manual_seed(0))


def rel_error(x, y):
    return (torch.linalg.vector_norm(x - y) / torch.linalg.vector_norm(x)).item()


@pytest.mark.parametrize("name, bound", [("none", 0.0), ("fp16", 1e-3), ("bf16", 5e-3), ("int8", 2e-2)])
def test_round_trip_error(gaussian, name, bound):
    codec = get_codec(name)
    decoded = codec.decode(codec.encode(gaussian), gaussian.numel())
    assert decoded.dtype == torch.float32 and decoded.shape == gaussian.shape
    assert rel_error(gaussian, decoded) <= bound
    if name == "none":
        assert torch.equal(decoded, gaussian)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 1000])
def test_encoded_size_is_exact(name, numel):
    codec = get_codec(name)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    buf = codec.encode(x)
    assert len(buf) == codec.encoded_size(numel)
    decoded = codec.decode(memoryview(buf), numel)
    assert decoded.shape == (numel,)
    decoded += 1.0  # fresh and writable


def test_int8_layout_and_sizes():
    codec = Int8Compression()
    assert [codec.encoded_size(n) for n in (0, 1, 255, 256, 257)] == [0, 5, 259, 260, 265]
    x = torch.tensor([0.5, -1.27, 0.0], dtype=torch.float32)
    buf = codec.encode(x)
    scale = np.frombuffer(buf[:4], dtype="<f4")[0]
    assert scale == np.float32(np.float32(1.27) / np.float32(127.0))
    assert np.frombuffer(buf[4:], dtype=np.int8).tolist() == [50, -127, 0]
    assert Int8Compression(block_size=2).encoded_size(3) == 8 + 3


def test_int8_zero_block():
    codec = Int8Compression(block_size=4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0], dtype=torch.float32)
    decoded = codec.decode(codec.encode(x), 6)
    assert decoded[:4].tolist() == [0.0] * 4
    torch.testing.assert_close(decoded[4:], x[4:], rtol=0, atol=1e-2)


@pytest.mark.parametrize("name", CODECS)
def test_decode_rejects_wrong_length(name):
    codec = get_codec(name)
    buf = codec.encode(torch.randn(300))
    for bad in (buf[:-1], buf + b"\x00", b""):
        with pytest.raises(ValueError):
            codec.decode(bad, 300)
    with pytest.raises(ValueError):
        codec.decode(buf, 301)
    with pytest.raises(ValueError):
        codec.decode(buf, -1)


@pytest.mark.parametrize("bad_scale", [float("nan"), float("inf"), -1.0])
def test_int8_decode_rejects_bad_scales(bad_scale):
    codec = Int8Compression()
    buf = bytearray(codec.encode(torch.randn(300)))
    buf[4:8] = np.array([bad_scale], dtype="<f4").tobytes()  # the second block's scale
    with pytest.raises(ValueError, match="scale"):
        codec.decode(bytes(buf), 300)


@pytest.mark.parametrize("codec, dtype", [(NoCompression(), "<f4"), (Float16Compression(), "<f2")])
def test_decode_rejects_non_finite_values(codec, dtype):
    buf = np.array([1.0, np.nan], dtype=dtype).tobytes()
    with pytest.raises(ValueError):
        codec.decode(buf, 2)


def test_fp16_saturates():
    codec = Float16Compression()
    x = torch.tensor([1e6, -1e6, 65504.0, 1.0], dtype=torch.float32)
    assert codec.decode(codec.encode(x), 4).tolist() == [65504.0, -65504.0, 65504.0, 1.0]


@pytest.mark.parametrize("name", CODECS)
def test_encoding_is_deterministic(name):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    assert get_codec(name).encode(x) == get_codec(name).encode(x.clone())


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(4, dtype=torch.float64),
        torch.zeros(2, 2),
        torch.tensor([1.0, float("nan")]),
        [1.0, 2.0],
    ],
)
@pytest.mark.parametrize("name", CODECS)
def test_encode_rejects_bad_input(name, bad):
    with pytest.raises(ValueError):
        get_codec(name).encode(bad)


def test_get_codec_unknown_lists_valid_names():
    assert [get_codec(n).name for n in CODECS] == list(CODECS)
    with pytest.raises(ValueError, match="none, fp16, bf16, int8"):
        get_codec("zstd")


def test_all_finite_fast_path_and_exact_fallback():
    from protocols.codecs import all_finite

    x = torch.randn(10_000)
    assert all_finite(x) and all_finite(torch.empty(0))
    big = torch.full((1000,), 3e38)  # finite values whose float32 sum overflows: the exact check decides
    assert all_finite(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1234] = bad
        assert not all_finite(y)
        assert not all_finite(y.numpy())
    y = big.clone()
    y[0] = float("inf")
    assert not all_finite(y)
    # half precisions are summed in fp32: 60,000 (near fp16's max) a thousand times over is finite, one inf is not
    for dtype in (torch.float16, torch.bfloat16):
        half = torch.full((1000,), 60_000.0, dtype=dtype)
        assert all_finite(half) and all_finite(half[::3])
        half[999] = float("inf")
        assert not all_finite(half)
    assert all_finite(torch.full((1000,), 60_000.0, dtype=torch.float16).numpy())
