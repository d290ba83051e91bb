"""The scaled-sign codec (``"sign"``, 1 bit per value + a scale per 64 values): exact sizes, what it decodes to, bad
bytes refused, and among in-process peers: bit-identical members, 10x fewer bytes than fp16."""

import asyncio

import numpy as np
import pytest
import torch

from peerd.config import ConfigError
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceConfig
from protocols.codecs import decode_tensor, encode_tensor, get_codec
from protocols.diloco import weighted_average
from protocols.wire import ProtocolViolation

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096])
def test_sign_encoded_size_is_exact(numel):
    codec = get_codec("sign")
    expected = 4 * -(-numel // 64) + -(-numel // 8)
    assert codec.encoded_size(numel) == expected
    assert len(codec.encode(torch.randn(numel))) == expected


def test_sign_decodes_to_the_sign_times_each_blocks_mean_magnitude():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(150, generator=g)
    x[5] = 0.0  # zero counts as non-negative
    codec = get_codec("sign")
    y = codec.decode(codec.encode(x), x.numel())
    for a, b in ((0, 64), (64, 128), (128, 150)):  # the last block is short: its mean is over 22 values
        scale = x[a:b].abs().sum() / (b - a)
        expected = torch.where(x[a:b] >= 0, scale, -scale)
        assert torch.equal(y[a:b] >= 0, x[a:b] >= 0) and len(set(y[a:b].abs().tolist())) == 1
        torch.testing.assert_close(y[a:b], expected, rtol=1e-6, atol=0)  # the scale up to summation order
    assert y[5] > 0
    # the block's scale minimizes the squared error for that sign pattern: any other scale does worse
    for factor in (0.9, 1.1):
        assert float((x - y).norm()) < float((x - y * factor).norm())


def test_sign_is_deterministic_and_refused_on_the_n_d_path_unless_asked():
    x = torch.randn(1000)
    codec = get_codec("sign")
    assert codec.encode(x) == codec.encode(x.clone())
    assert not codec.sparse
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


def test_sign_members_are_bit_identical_with_a_tenth_of_fp16s_bytes(averaging_peers):
    async def main():
        n, numel = 3, 3 * 8192
        peers = await averaging_peers(Hub(), n, allreduce=AllReduceConfig(
            compression="sign", sender_timeout_s=20.0, reducer_timeout_s=40.0))  # nobody stalls: loose timeouts
        codec = get_codec("sign")
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(numel, generator=g) for _ in range(n)]
        ws = [1.0, 2.0, 3.0]
        results = await asyncio.gather(*[p.round("s0", x, w, expected=n) for p, x, w in zip(peers, xs, ws)])
        # what reducer i answers: its part's weighted mean of the members' signed parts, signed once more
        signed = [torch.cat([codec.decode(codec.encode(p.contiguous()), p.numel()) for p in torch.tensor_split(x, n)])
                  for x in xs]
        mean = weighted_average(signed, ws)
        expected = torch.cat([codec.decode(codec.encode(p.contiguous()), p.numel()) for p in torch.tensor_split(mean, n)])
        fp16_bytes = 2 * (n - 1) / n * numel * 2
        for res in results:
            assert torch.equal(res.averaged.view(torch.int32), results[0].averaged.view(torch.int32))
            assert res.sent is None  # no error feedback
            torch.testing.assert_close(res.averaged, expected, rtol=1e-6, atol=1e-6)
            assert res.bytes_sent < fp16_bytes / 10  # 1.5 bits per value each way instead of 16

    asyncio.run(main())


def test_sign_is_refused_where_outer_states_are_averaged():
    for method in ("gossip", "moshpit"):
        with pytest.raises(ConfigError, match="sign"):
            RunConfig(averaging=AveragingConfig.from_flat(method=method, compression="sign"))
    run = RunConfig(averaging=AveragingConfig.from_flat(compression="sign"))
    assert run.averaging.allreduce().make_codec().name == "sign"
