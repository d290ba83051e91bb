"""The uplink measured from what receivers acknowledged while the path held the sending back
(peerd/transport/uplink.py ``UplinkMeter``), and paced at from the next all-reduce on where no rate is declared; the
kernel's counters and settings of a connection it relies on (``send_counters``, ``set_congestion``)."""

import asyncio
import socket
import threading
import time
import types

import pytest

from peerd.events import BandwidthCaps
from peerd.transport.connection import SendCounters, send_counters
from peerd.transport.pacing import pace
from peerd.transport.uplink import UplinkMeter, UplinkShares

pytestmark = pytest.mark.timeout(60)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Links:
    """Connections whose counters the test moves: bytes delivered, and seconds the path held them back."""

    def __init__(self, clock: _Clock):
        self.clock = clock
        self.of: dict[str, dict[int, SendCounters]] = {}

    def __call__(self, peer: str) -> dict[int, SendCounters]:
        return dict(self.of.get(peer, {}))

    def add(self, peer: str, key: int, acked: int = 0, path_s: float = 0.0) -> None:
        self.of.setdefault(peer, {})[key] = SendCounters(acked, 1, path_s)  # segments of one byte: bytes

    def move(self, peer: str, key: int, nbytes: int, path_s: float) -> None:
        c = self.of[peer][key]
        self.of[peer][key] = SendCounters(c.segments_delivered + nbytes, 1, c.path_limited_s + path_s)


def _stretch(meter: UplinkMeter, links: _Links, steps: list[dict[tuple[str, int], tuple[float, float]]],
             paced_at: float | None = None, paces: dict[str, float] | None = None) -> None:
    """One stretch of sending, 0.1 s a step: (peer, key) -> (bytes/s delivered, share of the step path-bound);
    ``paced_at`` the uplink's rate it is paced at shares of, ``paces`` each peer's pace."""
    paces = {peer: (paces or {}).get(peer) for peer in links.of}
    meter.begin(paced_at)
    meter.sample(paces)
    for step in steps:
        links.clock.now += 0.1
        for (peer, key), (rate, bound) in step.items():
            links.move(peer, key, int(rate * 0.1), bound * 0.1)
        meter.sample(paces)
    meter.end()


def test_the_peak_is_the_best_path_bound_window_the_rate_the_median_peak_and_a_pace_that_bound_climbs():
    clock = _Clock()
    links = _Links(clock)
    links.add("a", 1)
    links.add("b", 7)
    meter = UplinkMeter(links, window_s=0.5, history=3, gain=1.05, reach=0.97, max_rate=1e9, clock=clock)
    assert meter.rate() is None  # nothing measured: not paced
    both = lambda ra, rb: {("a", 1): (ra, 1.0), ("b", 7): (rb, 1.0)}  # noqa: E731
    _stretch(meter, links, [both(1e6, 1e6)] * 10 + [both(3e6, 1e6)] * 6 + [both(0.5e6, 0)] * 5)
    assert meter.peaks[-1] == pytest.approx(4e6) and meter.path_limited == 1.0  # 4 MB/s for 0.6 s
    assert meter.rate() == pytest.approx(4e6)  # unpaced: no climb
    _stretch(meter, links, [both(1e6, 1e6)] * 10)  # one high reading is not paced at: the lower of two
    assert list(meter.peaks) == pytest.approx([4e6, 2e6]) and meter.rate() == pytest.approx(2e6)
    halves = lambda rate: {"a": rate / 2, "b": rate / 2}  # noqa: E731 (each connection's pace)
    _stretch(meter, links, [both(1e6, 1e6)] * 10, paced_at=2e6, paces=halves(2e6))  # the pace bound it: 5% more
    assert meter.rate() == pytest.approx(2.1e6)
    _stretch(meter, links, [both(1.05e6, 1.05e6)] * 10, paced_at=2.1e6, paces=halves(2.1e6))  # and again
    assert list(meter.peaks) == pytest.approx([2e6, 2e6, 2.1e6]) and meter.rate() == pytest.approx(2.205e6)
    # the path held it at 2.1: the median
    _stretch(meter, links, [both(1.05e6, 1.05e6)] * 10, paced_at=2.205e6, paces=halves(2.205e6))
    assert list(meter.peaks) == pytest.approx([2e6, 2.1e6, 2.1e6]) and meter.rate() == pytest.approx(2.1e6)
    # shorter than a window: measures nothing
    _stretch(meter, links, [both(5e6, 5e6)] * 3, paced_at=2.1e6, paces=halves(2.1e6))
    assert meter.rate() == pytest.approx(2.1e6) and len(meter.peaks) == 3


def test_a_pace_that_bound_a_connection_holds_while_slower_receivers_keep_the_total_below_it():
    """Two peers behind slow downloads take 1 MB/s each of their 2 MB/s paces; a third moves at its own pace: the
    uplink was not shown full, and the rate holds (dropping to what the receivers allowed, then pacing the fast
    connection at a share of that, measured less and less every round)."""
    clock = _Clock()
    links = _Links(clock)
    for key, peer in enumerate("abc"):  # a connection's key is unique across peers (DirectStreams: its id)
        links.add(peer, key)
    meter = UplinkMeter(links, window_s=0.5, history=3, gain=1.05, reach=0.97, max_rate=1e9, clock=clock)
    step = {("a", 0): (2e6, 1.0), ("b", 1): (1e6, 1.0), ("c", 2): (1e6, 1.0)}
    _stretch(meter, links, [{k: (v[0] * 2, 1.0) for k, v in step.items()}] * 10)  # unpaced: 8 MB/s
    assert meter.rate() == pytest.approx(8e6)
    paces = {"a": 2.67e6, "b": 2.67e6, "c": 2.67e6}  # shares of a third each
    for _ in range(3):
        _stretch(meter, links, [{**step, ("a", 0): (2.67e6, 1.0)}] * 10, paced_at=8e6, paces=paces)
        assert meter.peaks[-1] == pytest.approx(4.67e6) and meter.rate() == pytest.approx(8e6)  # held
    # no connection at its pace (they all share a bottleneck below it): the rate is what got through
    _stretch(meter, links, [step] * 10, paced_at=8e6, paces=paces)
    assert meter.rate() == pytest.approx(4e6, rel=0.2)


def test_connections_paced_above_their_path_neither_hold_nor_climb_though_bunched_acknowledgements_read_at_pace():
    """8 peers on equal links: 7 connections, each paced at 1/7 of 14 MB/s where the path carries 12; their
    acknowledgements arrive in bunches, so over half a second a connection reads 0.7 to 1.3 times its average, above
    its pace. Over the stretch none moved at its pace: the rate falls back to the peaks measured instead of holding
    (or climbing from) the pace above the link."""
    clock = _Clock()
    links = _Links(clock)
    peers = [f"p{i}" for i in range(7)]
    for key, peer in enumerate(peers):
        links.add(peer, key)
    meter = UplinkMeter(links, window_s=0.5, history=3, gain=1.05, reach=0.98, max_rate=1e9, clock=clock)
    bunched = [1.3] * 5 + [0.7] * 5  # each connection's rate per 0.1 s step, as a factor of its average
    steps = [{(peer, key): (12e6 / 7 * bunched[(step + key) % 10], 1.0) for key, peer in enumerate(peers)}
             for step in range(30)]
    _stretch(meter, links, steps)  # unpaced: the peaks measured, bunched a little above the path's rate
    measured = meter.rate()
    assert 12e6 < measured < 13e6
    paces = {peer: 14e6 / 7 for peer in peers}
    first = [s[("p0", 0)][0] for s in steps]
    assert max(sum(first[i:i + 5]) / 5 for i in range(26)) > 0.98 * paces["p0"]  # a window of one reads at its pace
    for _ in range(3):
        _stretch(meter, links, steps, paced_at=14e6, paces=paces)
        assert meter.rate() == pytest.approx(measured)  # the median peak, not 14 (held) or 14.7 (climbed)


def test_a_sender_slower_than_its_path_measures_nothing():
    """As on loopback: the bytes leave as fast as the sender writes them, so the path holds nothing back."""
    clock = _Clock()
    links = _Links(clock)
    links.add("a", 1)
    links.add("b", 2)
    meter = UplinkMeter(links, window_s=0.5, path_bound=0.8, clock=clock)
    _stretch(meter, links, [{("a", 1): (50e6, 0.4), ("b", 2): (50e6, 0.45)}] * 20)
    assert not meter.peaks and meter.rate() is None and meter.path_limited == pytest.approx(0.45)
    # path-bound on one connection for 0.85 of every window: the path is the limit there
    _stretch(meter, links, [{("a", 1): (6e6, 0.85), ("b", 2): (6e6, 0.1)}] * 20)
    assert meter.peaks[-1] == pytest.approx(12e6) and meter.rate() == pytest.approx(12e6)


def test_a_new_connection_counts_from_where_it_is_first_seen_and_a_fast_link_is_not_paced():
    clock = _Clock()
    links = _Links(clock)
    meter = UplinkMeter(links, window_s=0.5, gain=1.0, max_rate=3e6, clock=clock)
    links.add("a", 1, acked=10**9, path_s=50.0)  # counted before this stretch: not counted
    meter.begin()
    meter.sample({"a": None})
    for step in range(10):
        clock.now += 0.1
        if step == 5:  # dialled again: a new key counting from its own start, the old one gone
            links.of["a"] = {}
            links.add("a", 2, acked=1, path_s=0.0)
        else:
            links.move("a", 2 if 2 in links.of["a"] else 1, 100_000, 0.1)
        meter.sample({"a": None})
    meter.end()
    assert 0.7e6 < meter.peaks[-1] <= 1e6 and meter.rate() == meter.peaks[-1]
    for _ in range(2):  # 5 MB/s, twice (the median): above max_rate, where processors bound it
        _stretch(meter, links, [{("a", 2): (5e6, 1.0)}] * 10)
    assert meter.peaks[-1] == pytest.approx(5e6) and meter.rate() is None
    for bad in ({"gain": 0.9}, {"reach": 0}, {"path_bound": 1.5}, {"window_s": 0}):
        with pytest.raises(ValueError):
            UplinkMeter(links, **bad)


def test_without_a_declared_rate_the_first_run_measures_and_the_next_runs_are_paced_at_shares_of_it(caplog):
    paced: list[tuple[str, object]] = []
    start = time.monotonic()

    def counters(peer: str) -> dict[int, SendCounters]:  # 1 MB/s reaches each receiver, the path the limit
        elapsed = time.monotonic() - start
        return {hash(peer): SendCounters(int(1e3 * elapsed), 1000, elapsed)}

    async def main():
        meter = UplinkMeter(counters, window_s=0.05, sample_s=0.01, gain=1.0)
        uplink = UplinkShares(None, lambda peer, rate: paced.append((peer, rate)) or True, meter)
        assert uplink.rate is None and uplink.declared is None
        lease = uplink.share({"a": 0.5, "b": 0.5})
        await asyncio.sleep(0.2)
        lease.close()
        assert paced == [] and meter.peaks[-1] == pytest.approx(2e6, rel=0.2)  # a and b: 2 MB/s together
        with caplog.at_level("INFO", logger="peerd.transport.uplink"):
            lease = uplink.share({"a": 0.25, "b": 0.75})
        assert uplink.rate == pytest.approx(2e6, rel=0.2)
        assert [r.getMessage().split(" MB/s")[0] for r in caplog.records] == [  # said when first known
            f"uplink measured at {uplink.rate / 1e6:.1f}"]
        assert dict(paced) == {"a": pytest.approx(0.25 * uplink.rate), "b": pytest.approx(0.75 * uplink.rate)}
        await asyncio.sleep(0.2)
        lease.close()
        assert paced[-2:] in ([("a", None), ("b", None)], [("b", None), ("a", None)])
        assert len(meter.peaks) == 2 and uplink._sampler is None  # the sampler ends with the last lease
        paced_streams = pace(types.SimpleNamespace(pace=lambda peer, rate: True, send_counters=counters))
        paced_streams.uplink.meter.peaks.extend(meter.peaks)
        report = paced_streams.report()["uplink"]
        assert report["measured"] and report["bytes_per_s"] == pytest.approx(min(meter.peaks))  # the lower of two
        assert report["peaks_bytes_per_s"] == [round(p) for p in meter.peaks]
        assert "uplink" not in pace(types.SimpleNamespace()).report()  # streams that cannot pace: nothing to say

    asyncio.run(main())
    with pytest.raises(ValueError):
        UplinkShares(None, lambda peer, rate: True)


def test_streams_that_tell_their_counters_get_a_measured_uplink_and_the_daemon_says_so(tmp_path):
    from peerd.config import NodeConfig
    from peerd.service.volunteer import VolunteerServices

    streams = types.SimpleNamespace(pace=lambda peer, rate: True, send_counters=lambda peer: {}, can_pace=True)
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
    assert published[0].message() == (  # no caps: not a list of "unlimited"s
        "no bandwidth caps; all-reduce connections paced at their shares of the uplink as measured during earlier "
        "all-reduces (uplink_mb_s declares it)")


def test_send_counters_count_the_segments_that_reached_the_receiver_and_the_seconds_the_path_held_the_sending_back():
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
        start = send_counters(client)
        if start is None:  # not Linux (or a kernel older than 4.10): nothing to count
            return
        client.sendall(b"x" * 3_000_000)
        assert received.wait(20)
        deadline = time.monotonic() + 20
        def delivered_bytes() -> int:  # segments of at most segment_bytes each (which grows once the peer's is known)
            now = send_counters(client)
            return (now.segments_delivered - start.segments_delivered) * now.segment_bytes

        while delivered_bytes() < 3_000_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        end = send_counters(client)
        assert end.segment_bytes > 0  # loopback: ~64 KiB
        assert 3_000_000 <= delivered_bytes() <= 2 * 3_000_000  # a bulk sender's segments are full
        assert 0 <= end.path_limited_s - start.path_limited_s < 20  # loopback: the receiver's window, if anything
    finally:
        for s in (client, conn, server):
            s.close()
    assert send_counters(client) is None  # closed: nothing to say


def test_set_congestion_uses_the_named_control_and_changes_nothing_for_one_the_system_lacks():
    from peerd.transport.connection import set_congestion

    sock = socket.socket()
    try:
        if not hasattr(socket, "TCP_CONGESTION"):  # not Linux: nothing can be set
            assert not set_congestion(sock, "reno")
            return
        before = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")
        assert not set_congestion(sock, "") and not set_congestion(sock, "no-such-control")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == before
        assert set_congestion(sock, "reno")  # built into every Linux kernel
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"reno"
    finally:
        sock.close()
