"""Each all-reduce paces its connections at their shares of the peer's uplink (peerd/transport/uplink.py, the
butterfly's ``_pace_uplink``), and lifts the pace when the run ends, failed or not."""

import asyncio
import types
from typing import Any, Optional

import pytest
import torch

from peerd.events import BandwidthCaps
from peerd.transport.inprocess import Hub
from peerd.transport.pacing import pace
from peerd.transport.uplink import UplinkShares
from protocols.allreduce import AllReduceConfig, AllReduceFailed
from protocols.allreduce.parts import connection_shares

pytestmark = pytest.mark.timeout(60)


class _Recorder:
    """Streams that can pace: every ``pace`` call recorded, and the pace each stream was opened under."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.calls: list[tuple[str, Optional[float]]] = []
        self.now: dict[str, Optional[float]] = {}
        self.opened_under: list[tuple[str, str, Optional[float]]] = []
        self.on_pace: Any = None  # on_pace(peer, rate), called on each pace

    def pace(self, peer: str, rate: Optional[float]) -> bool:
        if self.on_pace is not None:
            self.on_pace(peer, rate)
        self.calls.append((peer, rate))
        self.now[peer] = rate
        return True

    async def open(self, peer: str, name: str):
        self.opened_under.append((peer, name, self.now.get(peer)))
        return await self._inner.open(peer, name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Transport:
    def __init__(self, inner: Any, streams: Any):
        self._inner, self.streams = inner, streams

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_shares_are_paced_at_their_part_of_the_rate_add_up_across_runs_and_are_given_back():
    calls = []
    uplink = UplinkShares(1000.0, lambda peer, rate: calls.append((peer, rate)) or True)
    first = uplink.share({"a": 0.25, "b": 0.75, "c": 0.0})
    assert calls == [("a", 250.0), ("b", 750.0)]  # a share of 0 holds nothing
    second = uplink.share({"b": 0.5})
    assert calls[-1] == ("b", 1000.0) and uplink.held("b") == 1.0  # 1.25 of the link capped at the whole link
    first.close()
    assert calls[-2:] == [("a", None), ("b", 500.0)]  # a unpaced again, b still held by the second run
    first.close()  # closed already: nothing changes
    assert len(calls) == 5
    second.close()
    assert calls[-1] == ("b", None) and uplink.held("b") == 0.0
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        uplink.share({"a": 1.5})
    with pytest.raises(ValueError, match="> 0"):
        UplinkShares(0.0, lambda peer, rate: True)


def test_a_released_share_goes_to_the_connections_still_sending_and_the_last_one_leaves_them_unpaced():
    paced = {}
    uplink = UplinkShares(1200.0, lambda peer, rate: paced.__setitem__(peer, rate) or True)
    lease = uplink.share({"a": 0.5, "b": 0.25, "c": 0.25})
    lease.release("a")  # a's half goes to b and c, in proportion to theirs: the link stays full
    assert paced == {"a": None, "b": 600.0, "c": 600.0}
    lease.release("a")  # released already: nothing changes
    lease.release("b")
    assert paced == {"a": None, "b": None, "c": 1200.0}
    lease.release("c")
    assert paced == {"a": None, "b": None, "c": None}
    lease.close()
    assert uplink.held("c") == 0.0
    other = uplink.share({"a": 0.25})
    lease = uplink.share({"a": 0.25, "b": 0.25})
    lease.release("b")  # b's share goes to a, which another run holds a quarter of too
    assert paced["a"] == 300.0 + 600.0 and paced["b"] is None
    lease.close()
    assert paced["a"] == 300.0  # the other run still holds its quarter
    other.close()
    assert paced["a"] is None


def test_the_uplink_is_the_declared_rate_or_the_upload_cap_where_lower_and_needs_streams_that_pace():
    recorder = _Recorder(object())
    assert pace(recorder, uplink_bytes_per_s=2e6).uplink.rate == 2e6
    assert pace(recorder, upload_bytes_per_s=1e6, uplink_bytes_per_s=2e6).uplink.rate == 1e6  # the cap is lower
    assert pace(recorder, upload_bytes_per_s=3e6, uplink_bytes_per_s=2e6).uplink.rate == 2e6
    assert pace(recorder, upload_bytes_per_s=1e6).uplink.rate == 1e6  # a cap alone counts as the uplink
    assert pace(recorder).pace_uplink({"a": 1.0}) is None  # no rate known: nothing paced
    assert pace(object(), uplink_bytes_per_s=2e6).pace_uplink({"a": 1.0}) is None  # streams that cannot pace
    recorder.can_pace = False  # e.g. DirectStreams without multiplexed connections, or not on Linux
    assert pace(recorder, uplink_bytes_per_s=2e6).uplink is None
    assert recorder.calls == []


def test_the_caps_event_says_when_all_reduces_are_paced():
    assert BandwidthCaps(0.0, 5.0).message() == "bandwidth caps: upload unlimited, download 5 MB/s"
    assert BandwidthCaps(10.0, 0.0, 10.0).message() == ("bandwidth caps: upload 10 MB/s, download unlimited; "
                                                        "all-reduce connections paced at their shares of a 10 MB/s "
                                                        "uplink")


def test_connection_shares_follow_the_bytes_each_connection_carries():
    assert connection_shares([10, 30, 60], 0) == [0.0, 40 / 110, 70 / 110]
    assert connection_shares([25, 25, 25, 25], 2) == [1 / 3, 1 / 3, 0.0, 1 / 3]
    assert connection_shares([0, 0], 0) == [0.0, 0.0]


def _paced(recorders: list, rate: float):
    def wrap(i: int, transport: Any) -> Any:
        recorders.append(_Recorder(transport.streams))
        return _Transport(transport, pace(recorders[-1], uplink_bytes_per_s=rate))
    return wrap


def test_a_butterfly_paces_each_connection_at_its_share_while_it_runs_and_unpaces_it_after(averaging_peers):
    async def main():
        hub = Hub()
        recorders: list[_Recorder] = []
        peers = await averaging_peers(hub, 3, wrap=_paced(recorders, 1e6))
        results = await asyncio.gather(*[p.round("r0", torch.full((3000,), float(i)), 1.0, expected=3)
                                         for i, p in enumerate(peers)])
        assert all(torch.equal(r.averaged, torch.ones(3000)) for r in results)
        names = [p.transport.streams.peer_id for p in peers]
        for me, recorder in zip(names, recorders):
            others = [n for n in names if n != me]
            # equal parts of 3: each connection carries half of what we send; once our slice to one member is
            # handed over, the other gets the whole uplink
            assert recorder.calls[:2] == [(others[0], 5e5), (others[1], 5e5)] or \
                recorder.calls[:2] == [(others[1], 5e5), (others[0], 5e5)]
            assert set(rate for peer, rate in recorder.calls) == {5e5, 1e6, None}
            # our slices went up on streams opened while their connections were paced
            reduce_streams = [(peer, rate) for peer, name, rate in recorder.opened_under if name.endswith("reduce")]
            assert sorted(peer for peer, _ in reduce_streams) == sorted(others)
            assert all(rate in (5e5, 1e6) for _, rate in reduce_streams)
            assert all(recorder.now[peer] is None for peer in others)  # lifted once the run ended

    asyncio.run(main())


def test_a_member_s_connection_stays_paced_until_our_answer_to_it_was_handed_over_too(averaging_peers):
    """The connection to a member carries our slice of its part and our part's answer to it: its share is given to
    the others only once both were handed over (released after the slice alone, the answers went out unpaced)."""
    async def main():
        hub = Hub()
        recorders: list[_Recorder] = []
        config = AllReduceConfig(compression="none", sender_timeout_s=5.0, reducer_timeout_s=10.0, chunk_numel=4096)
        peers = await averaging_peers(hub, 3, allreduce=config, wrap=_paced(recorders, 1e6))
        names = [p.transport.streams.peer_id for p in peers]
        answered: dict[tuple[str, str], int] = {}  # (us, member) -> chunks of our answer handed over
        unpaced_after: list[tuple[str, str, int]] = []  # (us, member, chunks answered when it was unpaced)
        for me, peer, recorder in zip(names, peers, recorders):
            answer = peer.allreduce._answer

            async def counted_answer(request, session, reply_sizes, me=me, answer=answer):
                reply_frame = request.reply_frame

                async def counted(k, sizes, payload, **kwargs):
                    written = await reply_frame(k, sizes, payload, **kwargs)
                    answered[(me, request.peer)] = k + 1
                    return written

                request.reply_frame = counted
                return await answer(request, session, reply_sizes)

            peer.allreduce._answer = counted_answer

            def on_pace(member, rate, me=me):
                if rate is None:
                    unpaced_after.append((me, member, answered.get((me, member), 0)))

            recorder.on_pace = on_pace
        chunks = 4  # parts of 16,384 values in chunks of 4,096
        results = await asyncio.gather(*[p.round("r0", torch.full((3 * chunks * 4096,), float(i)), 1.0, expected=3)
                                         for i, p in enumerate(peers)])
        assert all(torch.equal(r.averaged, torch.ones(3 * chunks * 4096)) for r in results)
        assert sorted((me, member) for me, member, _ in unpaced_after) == sorted(
            (me, member) for me in names for member in names if member != me)  # each connection unpaced once...
        assert all(n == chunks for _, _, n in unpaced_after), unpaced_after  # ...after its whole answer

    asyncio.run(main())


def test_a_failed_run_unpaces_its_connections_too(averaging_peers):
    async def main():
        hub = Hub()
        recorders: list[_Recorder] = []
        peers = await averaging_peers(hub, 3, wrap=_paced(recorders, 1e6))
        groups = await asyncio.gather(*[p.matchmaker.form_group("r1", {}, expected_size=3) for p in peers])
        gone = groups[0].members[2]
        hub.disconnect(gone)
        survivors = [(p, r) for p, r in zip(peers, recorders) if p.transport.streams.peer_id != gone]
        results = await asyncio.gather(*[p.allreduce.run(groups[0], torch.ones(30), 1.0) for p, _ in survivors],
                                       return_exceptions=True)
        assert all(isinstance(r, AllReduceFailed) for r in results)
        for _, recorder in survivors:
            assert any(rate == 5e5 for _, rate in recorder.calls)  # it was paced...
            assert recorder.now and all(rate is None for rate in recorder.now.values())  # ...and is not any more

    asyncio.run(main())


def test_the_daemon_paces_at_the_declared_uplink_says_so_and_warns_where_its_streams_cannot(tmp_path, caplog):
    from peerd.config import NodeConfig
    from peerd.service.volunteer import VolunteerServices

    published = []

    async def main():
        for streams in (_Recorder(object()), object()):  # streams that pace (the direct plane), p2pd's that do not
            node = NodeConfig(checkpoint_dir=str(tmp_path), uplink_mb_s=12.5, upload_limit_mb_s=20.0)
            services = VolunteerServices(node, "worker", asyncio.Event(), run_id="r", environ={})
            services.events.publish = published.append
            paced = services.pace(types.SimpleNamespace(discovery=None, streams=streams))
            published.append(paced.streams.uplink.rate if paced.streams.uplink else None)

    asyncio.run(main())
    assert published[0] == BandwidthCaps(20.0, 0.0, 12.5) and published[1] == 12.5e6  # the lower of the two
    assert published[2] == BandwidthCaps(20.0, 0.0, 0.0) and published[3] is None
    assert [r.getMessage() for r in caplog.records if "not paced" in r.getMessage()] == [
        "uplink_mb_s = 12.5: not paced, the streams cannot pace their connections (data_plane = \"p2p\", or not Linux)"]
