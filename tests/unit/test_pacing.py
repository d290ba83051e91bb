"""Bandwidth caps: the token bucket, and measured rates of real protocol frames through paced in-process streams."""

import asyncio
import time

import pytest

from peerd.transport.inprocess import Hub
from peerd.transport.pacing import PacedTransport, RateMeter, TokenBucket, pace
from protocols.state_transfer import StateServer, StateSnapshot, download_state
from protocols.wire import read_frame, write_frame

pytestmark = pytest.mark.timeout(60)

MB = 1_000_000


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_token_bucket_grants_burst_then_rate(monkeypatch):
    clock = FakeClock()
    slept = []

    async def fake_sleep(seconds):
        slept.append(seconds)
        clock.t += seconds

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)

    async def main():
        bucket = TokenBucket(rate=1000, burst=500, clock=clock)
        await bucket.take(500)  # the burst: no wait
        assert slept == []
        await bucket.take(250)  # empty bucket: wait for 250 tokens
        assert slept == [pytest.approx(0.25)]
        await bucket.take(2000)  # more than the burst: granted once full (0.5 s), leaves a debt of 1500
        await bucket.take(100)  # pays the debt first: (1500 + 100) / 1000 s
        assert slept == [pytest.approx(0.25), pytest.approx(0.5), pytest.approx(1.6)]
        # long-run rate: everything past the first burst moved at exactly 1000 B/s
        assert clock.t == pytest.approx((250 + 2000 + 100) / 1000)

    asyncio.run(main())


def test_token_bucket_validation():
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(0)
    with pytest.raises(ValueError, match="burst"):
        TokenBucket(10, burst=0)


def test_rate_meter_ignores_idle_gaps():
    clock = FakeClock()
    meter = RateMeter(idle_gap_s=0.5, clock=clock)
    assert meter.achieved_rate() is None
    meter.start()
    clock.t = 1.0
    meter.done(1000)  # 1000 B in 1 s
    clock.t = 100.0  # idle for a long time (training)
    meter.start()
    clock.t = 101.0
    meter.done(3000)  # 3000 B in 1 s
    assert meter.total_bytes == 4000
    assert meter.busy_s == pytest.approx(2.0)
    assert meter.achieved_rate() == pytest.approx(2000.0)


async def _send_frame(sender, receiver_id: str, size: int) -> float:
    """Send one frame of ``size`` payload bytes to ``receiver_id``'s "sink" handler; returns the start time."""
    reader, writer = await sender.open(receiver_id, "sink")
    start = time.perf_counter()
    await write_frame(writer, {"part": 0}, bytes(size))
    writer.close()
    return start


def _pair(up_a=0.0, down_b=0.0):
    hub = Hub()
    a = pace(hub.transport("a").streams, upload_bytes_per_s=up_a)
    b = pace(hub.transport("b").streams, download_bytes_per_s=down_b)
    return a, b


def test_upload_cap_paces_protocol_writes():
    """2 MB/s on 6 MB takes >= ~2.9 s (the burst is 100 kB); the achieved rate never exceeds the cap by more than 10%
    and is at least what the receiver saw (a loaded machine may fall below the cap, never above it)."""
    async def main():
        a, b = _pair(up_a=2 * MB)
        done = asyncio.get_running_loop().create_future()

        async def sink(peer, reader, writer):
            header, payload, _ = await read_frame(reader, 10 * MB)
            done.set_result((time.perf_counter(), len(payload)))

        await b.add_handler("sink", sink)
        start = await _send_frame(a, "b", 6 * MB)
        end, received = await asyncio.wait_for(done, 30)
        return end - start, received, a.report()["upload"]

    seconds, received, report = asyncio.run(main())
    assert received == 6 * MB
    assert seconds >= 2.5, seconds
    assert seconds <= 6.0, seconds  # paced, not stalled
    assert report["bytes"] >= 6 * MB and report["limit_bytes_per_s"] == 2 * MB
    assert received / seconds * 0.95 <= report["achieved_bytes_per_s"] <= 2.2 * MB, (report, seconds)


def test_download_cap_paces_reads_of_a_state_transfer():
    """A capped reader downloading a 3 MB state over the state-transfer protocol takes >= ~1.4 s at 2 MB/s."""
    import torch

    async def main():
        hub = Hub()
        server_t = hub.transport("server")
        client_t = hub.transport("client")
        paced_client = PacedTransport(client_t.discovery, pace(client_t.streams, download_bytes_per_s=2 * MB))
        snapshot = StateSnapshot.from_tensors({"theta": torch.ones(750_000)}, {"outer_round": 1})
        server = StateServer(server_t, "t", lambda: snapshot)
        await server.start()
        start = time.perf_counter()
        got = await download_state(paced_client, "t", "server", max_bytes=4 * MB, timeout_s=30)
        seconds = time.perf_counter() - start
        return seconds, got, paced_client.streams.report()["download"]

    seconds, got, report = asyncio.run(main())
    assert len(got.payload) == 3 * MB
    assert 1.4 <= seconds <= 4.0, seconds
    assert 1.8 * MB <= report["achieved_bytes_per_s"] <= 2.2 * MB, report


def test_unlimited_streams_are_only_metered():
    async def main():
        a, b = _pair()
        done = asyncio.get_running_loop().create_future()

        async def sink(peer, reader, writer):
            _, payload, _ = await read_frame(reader, 100 * MB)
            done.set_result(len(payload))

        await b.add_handler("sink", sink)
        start = await _send_frame(a, "b", 20 * MB)
        assert await asyncio.wait_for(done, 30) == 20 * MB
        return time.perf_counter() - start, a.report(), b.report()

    seconds, a_report, b_report = asyncio.run(main())
    assert seconds < 2.0  # nothing slows an unlimited stream down
    assert a_report["upload"]["limit_bytes_per_s"] is None and a_report["upload"]["bytes"] >= 20 * MB
    assert b_report["download"]["bytes"] >= 20 * MB  # the serving side's reads are metered too
