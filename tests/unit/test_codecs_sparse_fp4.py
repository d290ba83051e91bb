"""fp4 (e2m1, blockwise scales) and top-k (SparseLoCo) codecs, and error feedback: sizes, bounds, bad bytes."""

import math

import numpy as np
import pytest
import torch

from protocols.codecs import ErrorFeedback, Fp4Compression, TopKCompression, decode_tensor, encode_tensor, get_codec
from protocols.wire import ProtocolViolation

pytestmark = pytest.mark.timeout(60)


def _randn(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("numel", [0, 1, 2, 63, 64, 65, 1001])
def test_fp4_encoded_size_is_exact(numel):
    payload = get_codec("fp4").encode(_randn(numel, numel))
    assert len(payload) == 4 * math.ceil(numel / 64) + math.ceil(numel / 2) == Fp4Compression().encoded_size(numel)


def test_fp4_grid_values_scaled_by_the_block_absmax_are_exact():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    x = torch.tensor(grid + [-g for g in grid[1:]], dtype=torch.float32) * 0.25  # absmax 1.5 -> scale 0.25
    codec = Fp4Compression()
    assert torch.equal(codec.decode(codec.encode(x), x.numel()), x)


@pytest.mark.parametrize("seed", range(3))
def test_fp4_error_is_within_the_half_gap_of_the_e2m1_grid(seed):
    x = _randn(64 * 20 + 7, seed) * torch.logspace(-3, 3, 64 * 20 + 7)  # blocks of very different scales
    codec = Fp4Compression()
    y = codec.decode(codec.encode(x), x.numel())
    padded = torch.zeros(64 * 21)
    padded[: x.numel()] = x
    scale = (padded.view(21, 64).abs().amax(dim=1) / 6).repeat_interleave(64)[: x.numel()]
    scaled = x.abs() / scale
    half_gap = torch.where(scaled <= 2, 0.25, torch.where(scaled <= 4, 0.5, 1.0))
    assert bool(((y - x).abs() <= half_gap * scale * (1 + 1e-5)).all())
    assert bool((torch.sign(y) * torch.sign(x) >= 0).all())  # never flips a sign


def test_fp4_n_d_round_trip_is_deterministic():
    x = _randn(2 * 3 * 50, 4).view(2, 3, 50).to(torch.bfloat16)
    header, payload = encode_tensor(x, "fp4")
    a, b = decode_tensor(header, bytes(payload)), decode_tensor(header, bytearray(payload))
    assert a.shape == (2, 3, 50) and a.dtype == torch.bfloat16
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert float((a.float() - x.float()).norm() / x.float().norm()) < 0.15


def test_fp4_bad_bytes_are_refused():
    codec = Fp4Compression()
    good = codec.encode(_randn(129))
    for bad_scale in (float("nan"), float("inf"), -1.0):
        buf = bytearray(good)
        buf[4:8] = np.array([bad_scale], dtype="<f4").tobytes()
        with pytest.raises(ValueError, match="scale"):
            codec.decode(bytes(buf), 129)
    buf = bytearray(good)
    buf[-1] |= 0x10  # the unused high nibble after the 129th value
    with pytest.raises(ValueError, match="padding"):
        codec.decode(bytes(buf), 129)
    buf = bytearray(good)
    buf[0:4] = np.array([3e38], dtype="<f4").tobytes()  # 6 * scale overflows
    with pytest.raises(ValueError, match="finite"):
        codec.decode(bytes(buf), 129)


@pytest.mark.parametrize("numel", [0, 1, 99, 4096, 4097, 10_000])
def test_topk_encoded_size_is_exact(numel):
    codec = TopKCompression()
    chunks = [min(4096, numel - s) for s in range(0, numel, 4096)]
    kept = sum(math.ceil(0.02 * m) for m in chunks)
    assert codec.kept(numel) == kept
    assert len(codec.encode(_randn(numel, numel))) == 8 * len(chunks) + 2 * kept + math.ceil(kept / 4)
    assert codec.encoded_size(numel) == 8 * len(chunks) + 2 * kept + math.ceil(kept / 4)


def test_topk_keeps_the_largest_magnitudes_of_each_chunk_with_two_levels():
    codec = TopKCompression(fraction=0.25, chunk_size=8)
    x = torch.tensor([0.1, -5.0, 0.2, 1.0, 0.3, -0.4, 2.0, 0.0,   # chunk 0: keeps -5, 2 (lo 2, hi 5)
                      7.0, 0.0, 0.0, -6.0, 0.0, 3.0, 0.0, 0.0,    # chunk 1: keeps 7, -6 (lo 6, hi 7)
                      1.0, -1.0, 0.5])                           # short chunk of 3: keeps one (tie -> index 0)
    y = codec.decode(codec.encode(x), x.numel())
    expected = torch.zeros_like(x)
    expected[[1, 6, 8, 11, 16]] = torch.tensor([-5.0, 2.0, 7.0, -6.0, 1.0])
    assert torch.equal(y, expected)
    x2 = torch.tensor([4.0, 0.0, -3.0, 0.0, 1.0, 0.0, 0.0, 0.0])  # keeps 4, -3: both exact
    codec2 = TopKCompression(fraction=0.5, chunk_size=8)
    y2 = codec2.decode(codec2.encode(x2), 8)  # keeps 4, -3, 1 and one 0 (lo 0, hi 4): 1 -> 0, -3 -> -4
    assert torch.equal(y2, torch.tensor([4.0, 0.0, -4.0, 0.0, 0.0, 0.0, 0.0, 0.0]))


def test_topk_round_trip_error_on_kept_values_is_at_most_half_the_level_gap():
    codec = TopKCompression(fraction=0.05, chunk_size=512)
    x = _randn(3000, 7)
    y = codec.decode(codec.encode(x), 3000)
    assert int((y != 0).sum()) <= codec.kept(3000)
    for start in range(0, 3000, 512):
        xs, ys = x[start:start + 512], y[start:start + 512]
        kept = ys != 0
        lo, hi = ys[kept].abs().min(), ys[kept].abs().max()
        assert bool(((ys[kept] - xs[kept]).abs() <= (hi - lo) / 2 + 1e-7).all())
        assert bool((xs[~kept].abs() <= lo).all())  # nothing dropped is larger than what was kept


def test_topk_is_deterministic_and_refused_by_default_on_the_n_d_path():
    x = _randn(5000, 1).view(50, 100)
    header, payload = encode_tensor(x, "topk")
    assert bytes(encode_tensor(x.clone(), "topk")[1]) == bytes(payload)
    with pytest.raises(ProtocolViolation, match="codec"):
        decode_tensor(header, payload)  # dense codecs only unless the receiver asks
    y = decode_tensor(header, payload, codecs=("topk",))
    assert y.shape == (50, 100)


def test_topk_bad_bytes_are_refused():
    codec = TopKCompression(fraction=0.25, chunk_size=16)
    x = _randn(40, 2)
    good = codec.encode(x)
    nchunks, kept = 3, codec.kept(40)
    idx_at = 8 * nchunks

    def corrupt(offset, data):
        buf = bytearray(good)
        buf[offset:offset + len(data)] = data
        return bytes(buf)

    cases = {
        "magnitudes": corrupt(0, np.array([float("nan")], "<f4").tobytes()),
        "lo <= hi": corrupt(0, np.array([5.0, 1.0], "<f4").tobytes()),
        "beyond": corrupt(idx_at, np.array([16], "<u2").tobytes()),
        "increasing": corrupt(idx_at + 2, good[idx_at:idx_at + 2]),
        "padding": corrupt(len(good) - 1, bytes([good[-1] | 0xC0])) if kept % 4 else None,
    }
    for match, buf in cases.items():
        if buf is None:
            continue
        with pytest.raises(ValueError, match=match):
            codec.decode(buf, 40)


def test_error_feedback_keeps_exactly_what_was_not_sent():
    codec = TopKCompression(fraction=0.1, chunk_size=64)
    g = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(300)
    total_delta, total_sent = torch.zeros(300), torch.zeros(300)
    for _ in range(5):
        delta = torch.randint(-64, 65, (300,), generator=g).float() / 16  # dyadic: every sum below is exact
        compensated = ef.compensate(delta)
        payload = ef.send(delta, codec)
        sent = codec.decode(payload, 300)
        assert torch.equal(ef.error, compensated - sent)
        total_delta += delta
        total_sent += sent
    assert torch.equal(total_sent + ef.error, total_delta)  # nothing lost, nothing invented
    assert float(ef.error.abs().sum()) > 0


def test_error_feedback_decay_and_bad_shapes():
    ef = ErrorFeedback(4, decay=0.5)
    ef.record(torch.tensor([2.0, 0.0, 0.0, 0.0]), torch.zeros(4))
    assert torch.equal(ef.compensate(torch.ones(4)), torch.tensor([2.0, 1.0, 1.0, 1.0]))
    assert torch.equal(ef.error, torch.tensor([2.0, 0.0, 0.0, 0.0]))  # compensate leaves the state alone
    with pytest.raises(ValueError):
        ef.compensate(torch.ones(5))
    with pytest.raises(ValueError):
        ef.record(torch.ones(4), torch.ones(3))
    with pytest.raises(ValueError):
        ErrorFeedback(4, decay=1.5)
