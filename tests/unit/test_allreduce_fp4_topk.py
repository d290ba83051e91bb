"""Butterfly all-reduce with the fp4 and sparse top-k codecs among in-process peers: bit-identical members."""

import asyncio

import pytest
import torch

from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceConfig
from protocols.codecs import ErrorFeedback, get_codec
from protocols.diloco import weighted_average

pytestmark = pytest.mark.timeout(60)


def _config(compression, result="auto"):
    # nobody stalls here: timeouts a loaded machine's event loop cannot miss (a sender left out by a 1 s timeout
    # under load made a part's mean one member's value)
    return AllReduceConfig(compression=compression, result_compression=result, sender_timeout_s=20.0,
                           reducer_timeout_s=40.0)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fp4_results_bit_identical_across_members(n, averaging_peers):
    async def main():
        peers = await averaging_peers(Hub(), n, allreduce=_config("fp4"))
        g = torch.Generator().manual_seed(n)
        xs = [torch.randn(3001, generator=g) for _ in range(n)]
        ws = [float(i + 1) for i in range(n)]
        results = await asyncio.gather(*[p.round("r0", x, w, expected=n) for p, x, w in zip(peers, xs, ws)])
        reference = weighted_average(xs, ws)
        for res in results:
            assert res.group_size == n and res.sent is None
            assert torch.equal(res.averaged.view(torch.int32), results[0].averaged.view(torch.int32))
        err = float((results[0].averaged - reference).norm() / reference.norm())
        assert err < 0.25, err  # quantized twice (parts, then the mean)

    asyncio.run(main())


def test_fp4_bytes_are_about_a_quarter_of_fp16(averaging_peers):
    async def main():
        n, numel = 4, 64 * 400
        peers = await averaging_peers(Hub(), n, allreduce=_config("fp4"))
        results = await asyncio.gather(*[p.round("r1", torch.randn(numel), 1.0, expected=n) for p in peers])
        part = numel // n
        payload = 2 * (n - 1) * get_codec("fp4").encoded_size(part)
        for r in results:
            assert payload <= r.bytes_sent <= payload * 1.1, (r.bytes_sent, payload)

    asyncio.run(main())


@pytest.mark.parametrize("n", [2, 3, 4])
def test_topk_members_get_the_bit_identical_dense_mean_of_the_sparse_parts(n, averaging_peers):
    async def main():
        peers = await averaging_peers(Hub(), n, allreduce=_config("topk", "none"))
        g = torch.Generator().manual_seed(10 + n)
        numel = 9000
        xs = [torch.randn(numel, generator=g) for _ in range(n)]
        ws = [float(i + 1) for i in range(n)]
        results = await asyncio.gather(*[p.round("r2", x, w, expected=n) for p, x, w in zip(peers, xs, ws)])
        codec = get_codec("topk")
        for res, x in zip(results, xs):
            assert torch.equal(res.averaged.view(torch.int32), results[0].averaged.view(torch.int32))
            # what each member contributed is its own parts, top-k encoded part by part
            parts = torch.tensor_split(x, n)
            expected_sent = torch.cat([codec.decode(codec.encode(p.contiguous()), p.numel()) for p in parts])
            assert torch.equal(res.sent, expected_sent)
        # with a lossless answer codec the result is exactly the weighted mean of the sparse contributions
        torch.testing.assert_close(results[0].averaged, weighted_average([r.sent for r in results], ws),
                                   rtol=1e-6, atol=1e-7)

    asyncio.run(main())


def test_topk_with_error_feedback_over_rounds_sends_less_than_fp16(averaging_peers):
    async def main():
        n, numel = 3, 12_000
        peers = await averaging_peers(Hub(), n, allreduce=_config("topk"))
        feedback = [ErrorFeedback(numel) for _ in range(n)]
        g = torch.Generator().manual_seed(0)
        for r in range(3):
            deltas = [torch.randn(numel, generator=g) for _ in range(n)]
            compensated = [ef.compensate(d) for ef, d in zip(feedback, deltas)]
            results = await asyncio.gather(*[p.round(f"ef{r}", c, 1.0, expected=n)
                                             for p, c in zip(peers, compensated)])
            for ef, c, res in zip(feedback, compensated, results):
                assert torch.equal(res.averaged, results[0].averaged)
                ef.record(c, res.sent)
                assert torch.equal(ef.error, c - res.sent)
                fp16_bytes = 2 * (n - 1) / n * numel * 2
                assert res.bytes_sent < 0.6 * fp16_bytes  # sparse up, fp16 down

    asyncio.run(main())


def test_a_sparse_answer_codec_is_refused():
    with pytest.raises(ValueError, match="dense"):
        AllReduceConfig(compression="topk", result_compression="topk")
