"""The scaled-sign codec (``"sign"``, 1 bit per value + a scale per block): exact sizes, what it decodes to, bad
bytes refused, and among in-process peers: bit-identical members, error feedback, less than fp16 by 14x."""

import asyncio

import numpy as np
import pytest
import torch

from peerd.config import ConfigError
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceConfig
from protocols.codecs import ErrorFeedback, decode_tensor, encode_tensor, get_codec
from protocols.wire import ProtocolViolation

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 255, 256, 257, 1000, 4096])
def test_sign_encoded_size_is_exact(numel):
    codec = get_codec("sign")
    expected = 4 * -(-numel // 256) + -(-numel // 8)
    assert codec.encoded_size(numel) == expected
    assert len(codec.encode(torch.randn(numel))) == expected


def test_sign_decodes_to_the_sign_times_each_blocks_mean_magnitude():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, generator=g)
    x[5] = 0.0  # zero counts as non-negative
    codec = get_codec("sign")
    y = codec.decode(codec.encode(x), x.numel())
    for a, b in ((0, 256), (256, 512), (512, 600)):  # the last block is short: its mean is over 88 values
        scale = x[a:b].abs().sum() / (b - a)
        expected = torch.where(x[a:b] >= 0, scale, -scale)
        assert torch.equal(y[a:b], expected)
    assert y[5] > 0
    # the block's scale minimizes the squared error for that sign pattern: any other scale does worse
    for factor in (0.9, 1.1):
        assert float((x - y).norm()) < float((x - y * factor).norm())


def test_sign_is_deterministic_and_refused_on_the_n_d_path_unless_asked():
    x = torch.randn(1000)
    codec = get_codec("sign")
    assert codec.encode(x) == codec.encode(x.clone())
    assert codec.error_feedback and not codec.sparse
    header, payload = encode_tensor(x, "sign")
    with pytest.raises(ProtocolViolation, match="not one of"):
        decode_tensor(header, payload)  # activations never travel as signs
    assert torch.equal(decode_tensor(header, payload, codecs=("sign",)), codec.decode(payload, 1000))


def test_sign_bad_bytes_are_refused():
    codec = get_codec("sign")
    good = bytearray(codec.encode(torch.randn(13)))  # 1 scale, 2 bytes of bits (3 padding bits)
    with pytest.raises(ValueError, match="expected"):
        codec.decode(bytes(good[:-1]), 13)
    negative = bytearray(good)
    negative[0:4] = np.float32(-1.0).tobytes()
    with pytest.raises(ValueError, match="scales"):
        codec.decode(bytes(negative), 13)
    nan = bytearray(good)
    nan[0:4] = np.float32("nan").tobytes()
    with pytest.raises(ValueError, match="scales"):
        codec.decode(bytes(nan), 13)
    padded = bytearray(good)
    padded[-1] |= 0x80
    with pytest.raises(ValueError, match="padding"):
        codec.decode(bytes(padded), 13)


def test_sign_members_are_bit_identical_and_error_feedback_keeps_what_was_not_sent(averaging_peers):
    async def main():
        n, numel = 3, 3 * 8192
        peers = await averaging_peers(Hub(), n, allreduce=AllReduceConfig(
            compression="sign", sender_timeout_s=1.0, reducer_timeout_s=2.0))
        codec = get_codec("sign")
        feedback = [ErrorFeedback(numel) for _ in range(n)]
        g = torch.Generator().manual_seed(1)
        total_delta, total_sent = torch.zeros(n, numel), torch.zeros(n, numel)
        for r in range(3):
            deltas = [torch.randn(numel, generator=g) for _ in range(n)]
            compensated = [ef.compensate(d) for ef, d in zip(feedback, deltas)]
            results = await asyncio.gather(*[p.round(f"s{r}", c, 1.0, expected=n)
                                             for p, c in zip(peers, compensated)])
            for i, (ef, c, res) in enumerate(zip(feedback, compensated, results)):
                assert torch.equal(res.averaged.view(torch.int32), results[0].averaged.view(torch.int32))
                parts = torch.tensor_split(c, n)  # what the reducers decoded: each part signed on its own
                assert torch.equal(res.sent, torch.cat([codec.decode(codec.encode(p.contiguous()), p.numel())
                                                        for p in parts]))
                ef.record(c, res.sent)
                total_delta[i] += deltas[i]
                total_sent[i] += res.sent
                # answers are signs too: 1.125 bits per value each way instead of 16
                fp16_bytes = 2 * (n - 1) / n * numel * 2
                assert res.bytes_sent < fp16_bytes / 12
        for i, ef in enumerate(feedback):  # nothing is lost: everything sent plus the error is every delta
            torch.testing.assert_close(total_sent[i] + ef.error, total_delta[i], rtol=0, atol=1e-5)

    asyncio.run(main())


def test_sign_is_refused_where_outer_states_are_averaged():
    for method in ("gossip", "moshpit"):
        with pytest.raises(ConfigError, match="sign"):
            RunConfig(averaging=AveragingConfig.from_flat(method=method, compression="sign"))
    run = RunConfig(averaging=AveragingConfig.from_flat(compression="sign"))
    assert run.averaging.allreduce().make_codec().name == "sign"
