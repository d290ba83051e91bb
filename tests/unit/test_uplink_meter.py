"""The uplink measured from what receivers acknowledged (peerd/transport/uplink.py ``UplinkMeter``), and paced at
from the next all-reduce on where no rate is declared."""

import asyncio
import socket
import threading
import time
import types

import pytest

from peerd.events import BandwidthCaps
from peerd.transport.connection import bytes_acked
from peerd.transport.pacing import pace
from peerd.transport.uplink import UplinkMeter, UplinkShares

pytestmark = pytest.mark.timeout(60)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_peak_is_the_highest_rate_acknowledged_over_a_window_and_the_rate_the_best_recent_peak_with_gain():
    clock, acked = _Clock(), {"a": {1: 0}, "b": {7: 0}}
    meter = UplinkMeter(lambda peer: acked[peer], window_s=0.5, history=2, gain=1.05, max_rate=1e9, clock=clock)
    assert meter.rate() is None  # nothing measured: not paced

    def run(rates_by_step: list[tuple[float, float]]) -> None:  # (bytes/s to a, bytes/s to b) per 0.1 s
        meter.begin()
        meter.sample(["a", "b"])
        for to_a, to_b in rates_by_step:
            clock.now += 0.1
            acked["a"][1] += int(to_a * 0.1)
            acked["b"][7] += int(to_b * 0.1)
            meter.sample(["a", "b"])
        meter.end()

    run([(1e6, 1e6)] * 10 + [(3e6, 1e6)] * 6 + [(0.5e6, 0)] * 5)  # 2 MB/s, then 4 MB/s for 0.6 s, then a tail
    assert meter.peaks[-1] == pytest.approx(4e6)
    assert meter.rate() == pytest.approx(4.2e6)
    run([(1e6, 1e6)] * 10)  # a slower stretch (its receivers were the slower side): the best recent peak counts
    assert list(meter.peaks) == pytest.approx([4e6, 2e6]) and meter.rate() == pytest.approx(4.2e6)
    run([(1e6, 1e6)] * 10)  # history=2: the 4 MB/s stretch is forgotten
    assert meter.rate() == pytest.approx(2.1e6)
    run([(5e6, 5e6)] * 3)  # shorter than a window: measures nothing
    assert meter.rate() == pytest.approx(2.1e6) and len(meter.peaks) == 2


def test_a_new_connection_counts_from_where_it_is_first_seen_and_a_fast_link_is_not_paced():
    clock, acked = _Clock(), {}
    meter = UplinkMeter(lambda peer: acked, window_s=0.5, gain=1.0, max_rate=3e6, clock=clock)
    meter.begin()
    acked[1] = 10**9  # bytes acknowledged before this stretch: not counted
    meter.sample(["a"])
    for step in range(10):
        clock.now += 0.1
        if step == 5:  # dialled again: a new key counting from its own start, the old one gone
            del acked[1]
            acked[2] = 1
        else:
            acked[2 if 2 in acked else 1] += 100_000
        meter.sample(["a"])
    meter.end()
    assert 0.7e6 < meter.peaks[-1] <= 1e6 and meter.rate() == meter.peaks[-1]
    meter.begin()
    meter.sample(["a"])
    for _ in range(10):
        clock.now += 0.1
        acked[2] += 500_000  # 5 MB/s: above max_rate, the processors bound it, not the link
        meter.sample(["a"])
    meter.end()
    assert meter.peaks[-1] == pytest.approx(5e6) and meter.rate() is None
    with pytest.raises(ValueError):
        UplinkMeter(lambda peer: {}, gain=0.9)


def test_without_a_declared_rate_the_first_run_measures_and_the_next_runs_are_paced_at_shares_of_it():
    paced: list[tuple[str, object]] = []
    start = time.monotonic()

    def acked(peer: str) -> dict[int, int]:  # each receiver acknowledges 1 MB/s
        return {hash(peer): int(1e6 * (time.monotonic() - start))}

    async def main():
        meter = UplinkMeter(acked, window_s=0.05, sample_s=0.01, gain=1.0)
        uplink = UplinkShares(None, lambda peer, rate: paced.append((peer, rate)) or True, meter)
        assert uplink.rate is None and uplink.declared is None
        lease = uplink.share({"a": 0.5, "b": 0.5})
        await asyncio.sleep(0.2)
        lease.close()
        assert paced == [] and meter.peaks[-1] == pytest.approx(2e6, rel=0.2)  # a and b: 2 MB/s together
        lease = uplink.share({"a": 0.25, "b": 0.75})
        assert uplink.rate == pytest.approx(2e6, rel=0.2)
        assert dict(paced) == {"a": pytest.approx(0.25 * uplink.rate), "b": pytest.approx(0.75 * uplink.rate)}
        await asyncio.sleep(0.2)
        lease.close()
        assert paced[-2:] in ([("a", None), ("b", None)], [("b", None), ("a", None)])
        assert len(meter.peaks) == 2 and uplink._sampler is None  # the sampler ends with the last lease
        paced_streams = pace(types.SimpleNamespace(pace=lambda peer, rate: True, acked_bytes=acked))
        paced_streams.uplink.meter.peaks.extend(meter.peaks)
        report = paced_streams.report()["uplink"]
        assert report["measured"] and report["bytes_per_s"] == pytest.approx(max(meter.peaks) * 1.05)
        assert report["peaks_bytes_per_s"] == [round(p) for p in meter.peaks]
        assert "uplink" not in pace(types.SimpleNamespace()).report()  # streams that cannot pace: nothing to say

    asyncio.run(main())
    with pytest.raises(ValueError):
        UplinkShares(None, lambda peer, rate: True)


def test_streams_that_tell_acknowledged_bytes_get_a_measured_uplink_and_the_daemon_says_so(tmp_path):
    from peerd.config import NodeConfig
    from peerd.service.volunteer import VolunteerServices

    streams = types.SimpleNamespace(pace=lambda peer, rate: True, acked_bytes=lambda peer: {}, can_pace=True)
    assert pace(streams).uplink.meter is not None and pace(streams).uplink.declared is None
    assert pace(streams, uplink_bytes_per_s=2e6).uplink.meter is None  # a declared rate is not measured
    assert pace(types.SimpleNamespace(pace=streams.pace)).uplink is None  # cannot tell: neither
    assert pace(types.SimpleNamespace(**{**vars(streams), "can_pace": False})).uplink is None
    published = []

    async def main():
        services = VolunteerServices(NodeConfig(checkpoint_dir=str(tmp_path)), "worker", asyncio.Event(), run_id="r",
                                     environ={})
        services.events.publish = published.append
        services.pace(types.SimpleNamespace(discovery=None, streams=streams))

    asyncio.run(main())
    assert published == [BandwidthCaps(0.0, 0.0, 0.0, True)]
    assert published[0].message() == (
        "bandwidth caps: upload unlimited, download unlimited; all-reduce connections paced at their shares of the "
        "uplink as measured during earlier all-reduces (uplink_mb_s declares it)")


def test_bytes_acked_counts_what_the_receiver_acknowledged():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    received = threading.Event()

    def read() -> None:
        total = 0
        while total < 3_000_000:
            total += len(conn.recv(1 << 20))
        received.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        start = bytes_acked(client)
        if start is None:  # not Linux: nothing to count
            assert not hasattr(socket, "TCP_INFO")
            return
        client.sendall(b"x" * 3_000_000)
        assert received.wait(20)
        deadline = time.monotonic() + 20
        while bytes_acked(client) - start < 3_000_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bytes_acked(client) - start == 3_000_000
    finally:
        for s in (client, conn, server):
            s.close()
    assert bytes_acked(client) is None  # closed: nothing to say
