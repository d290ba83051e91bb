"""The dial-back check: which addresses a helper dials, its limits, the service on in-process peers with a real TCP
dialer, and the verdict line a volunteer reads."""

import asyncio
import functools

import pytest

from peerd.transport.dialback import MULTISTREAM, check_transport, dialback_service, tcp_dial
from peerd.transport.inprocess import Hub
from protocols.reachability import (
    DialBackAnswer,
    DialBackService,
    DialLimiter,
    Refused,
    ask_dialback,
    parse_tcp,
    plan_dials,
    relays_of,
    verdict_of,
)
from protocols.rpc import call
from tests.ports import closed_port

pytestmark = pytest.mark.timeout(30)


def in_loop(test):
    """Run an async test body in a fresh event loop."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))

    return run

ME = "12D3KooWAsker"
OTHER = "12D3KooWVictim"


def test_parse_tcp_takes_only_direct_tcp_addresses():
    assert parse_tcp("/ip4/1.2.3.4/tcp/31337/p2p/" + ME).peer_id == ME
    assert parse_tcp("/ip6/::1/tcp/5").host == "::1"
    for bad in ("/dns4/example.org/tcp/1", "/ip4/1.2.3.4/udp/1/quic", "/ip4/1.2.3.4/tcp/0", "/ip4/1.2.3.4/tcp/70000",
                "/ip4/1.2.3.4/tcp/1/p2p/" + ME + "/p2p-circuit", "/ip4/::1/tcp/1", "/ip4/1.2.3/tcp/1", "garbage",
                "/ip4/1.2.3.4/tcp/+1"):
        assert parse_tcp(bad) is None, bad


def test_plan_dials_only_the_asker_and_its_observed_ip():
    addrs = ["/ip4/192.168.1.5/tcp/4001/p2p/" + ME, "/ip4/203.0.113.7/tcp/4001", "/ip4/203.0.113.7/tcp/5/p2p/" + OTHER,
             "/dns4/example.org/tcp/4001", "/ip4/203.0.113.7/tcp/4001/p2p/" + ME]
    to_dial, skipped = plan_dials(ME, addrs, observed="/ip4/203.0.113.7/tcp/55123")
    assert to_dial == ["/ip4/203.0.113.7/tcp/4001"]  # the private one is tried at the public IP, once
    reasons = dict(skipped)
    assert "another peer" in reasons["/ip4/203.0.113.7/tcp/5/p2p/" + OTHER]
    assert "direct TCP" in reasons["/dns4/example.org/tcp/4001"]
    assert "203.0.113.7" in reasons["/ip4/192.168.1.5/tcp/4001/p2p/" + ME]


def test_plan_dials_without_observed_address_and_cap():
    addrs = [f"/ip4/10.0.0.{i}/tcp/{1000 + i}" for i in range(1, 10)]
    to_dial, skipped = plan_dials(ME, addrs, observed=None, max_dials=4)
    assert to_dial == addrs[:4]
    assert [a for a, _ in skipped] == addrs[4:] and all("limit" in why for _, why in skipped)


def test_limiter_per_peer_and_global():
    now = [0.0]
    limiter = DialLimiter(per_peer_interval_s=30, per_minute=3, clock=lambda: now[0])
    assert limiter.admit("a") is None
    assert "per peer" in limiter.admit("a")
    assert limiter.admit("b") is None and limiter.admit("c") is None
    assert "a minute" in limiter.admit("d")
    now[0] = 61.0
    assert limiter.admit("a") is None and limiter.admit("d") is None


async def _libp2p_like_listener():
    """A TCP server that answers multistream-select's greeting, like any libp2p node."""

    async def serve(reader, writer):
        try:
            await reader.readexactly(1 + len(MULTISTREAM))
            writer.write(bytes([len(MULTISTREAM)]) + MULTISTREAM)
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _pair():
    hub = Hub()
    helper, asker = hub.transport("helper"), hub.transport(ME)
    return helper, asker


@in_loop
async def test_service_reports_reachable_and_unreachable_addresses():
    server, open_port = await _libp2p_like_listener()
    closed = await closed_port()
    helper, asker = _pair()
    service = DialBackService(tcp_dial, observed=lambda peer: "/ip4/127.0.0.1/tcp/40000")
    await service.start(helper)
    try:
        good, bad = f"/ip4/127.0.0.1/tcp/{open_port}/p2p/{ME}", f"/ip4/127.0.0.1/tcp/{closed}"
        answer = await ask_dialback(asker, "helper", [bad, good, "/ip4/127.0.0.1/tcp/9/p2p/" + OTHER])
        results = {a: ok for a, ok, _ in answer.results}
        assert results[f"/ip4/127.0.0.1/tcp/{open_port}"] is True
        assert results[f"/ip4/127.0.0.1/tcp/{closed}"] is False
        assert results["/ip4/127.0.0.1/tcp/9/p2p/" + OTHER] is False
        assert answer.observed == "/ip4/127.0.0.1/tcp/40000"
        verdict = verdict_of([answer], 1, [good])
        assert verdict.reachable and verdict.address == f"/ip4/127.0.0.1/tcp/{open_port}"
        assert verdict.line().startswith("reachable: ")
    finally:
        await service.stop()
        server.close()


@in_loop
async def test_rate_limit_and_malformed_request_exclude_the_peer_without_crashing():
    hub = Hub()
    helper, asker, other = hub.transport("helper"), hub.transport(ME), hub.transport("12D3KooWOther")
    bad_peers = []
    dials = []

    async def dial(peer, addrs, timeout_s):
        dials.append((peer, list(addrs)))
        return {a: (False, "refused") for a in addrs}

    service = DialBackService(dial, on_bad_peer=lambda peer, why: bad_peers.append((peer, why)))
    await service.start(helper)
    try:
        for i, header in enumerate(({"addrs": "not a list"}, {"addrs": [1, 2]}, {"addrs": ["/ip4/1.2.3.4/tcp/1"] * 17},
                                    {"addrs": ["x" * 300]}, {})):
            sender = asker if i == 0 else hub.transport(f"12D3KooWBad{i}")
            with pytest.raises(Refused) as refused:
                await call(sender.streams, "helper", "peerd.reach", "dialback", header, timeout_s=5)
            assert refused.value.code == "bad_request"
        assert [p for p, _ in bad_peers] == [ME] + [f"12D3KooWBad{i}" for i in range(1, 5)]
        with pytest.raises(Refused) as refused:  # excluded: a well-formed request no longer reaches the dialer
            await ask_dialback(asker, "helper", ["/ip4/127.0.0.1/tcp/4001"])
        assert refused.value.code == "banned"
        assert dials == []
        answer = await ask_dialback(other, "helper", ["/ip4/127.0.0.1/tcp/4001"])  # still serving the others
        assert answer.results == [("/ip4/127.0.0.1/tcp/4001", False, "refused")]
        with pytest.raises(Refused) as refused:  # a second check within the per-peer interval
            await ask_dialback(other, "helper", ["/ip4/127.0.0.1/tcp/4001"])
        assert refused.value.code == "busy" and "per peer" in refused.value.reason
        assert dials == [("12D3KooWOther", ["/ip4/127.0.0.1/tcp/4001"])]
    finally:
        await service.stop()


@in_loop
async def test_check_skips_failing_helpers_and_says_unreachable_with_a_fix():
    hub = Hub()
    me, liar, honest = hub.transport(ME), hub.transport("liar"), hub.transport("honest")
    hub.disconnect("gone")

    async def never(peer, addrs, timeout_s):
        return {a: (False, "connection refused") for a in addrs}

    class Liar(DialBackService):
        async def rpc_dialback(self, request):
            return {"observed": 5, "results": "yes"}

    liar_service = Liar(never)
    honest_service = DialBackService(never, observed=lambda peer: "/ip4/81.2.69.160/tcp/50000")
    await liar_service.start(liar)
    await honest_service.start(honest)
    me.visible_maddrs = lambda: ["/ip4/192.168.1.5/tcp/4001/p2p/" + ME]
    try:
        verdict = await check_transport(me, ["gone", "liar", ME, "honest"], relay="off")
        assert verdict.reachable is False and verdict.helpers == ["honest"] and verdict.asked == 3
        line = verdict.line()
        assert line.startswith("not reachable")
        assert "forward TCP port 4001" in line and '/ip4/81.2.69.160/tcp/4001' in line and 'relay = "auto"' in line
        unknown = await check_transport(me, ["gone"])
        assert unknown.reachable is None and unknown.line().startswith("reachability unknown")
    finally:
        await liar_service.stop()
        await honest_service.stop()


def test_dialback_service_uses_the_recorded_remote_address():
    class Streams:
        peer_id = "helper"
        observed = {ME: "/ip4/203.0.113.7/tcp/1234"}

    class Wrapper:
        def __init__(self, inner):
            self._inner = inner

    class Transport:
        streams = Wrapper(Streams())

    service = dialback_service(Transport(), dial=tcp_dial)
    assert service.observed(ME) == "/ip4/203.0.113.7/tcp/1234" and service.observed("x") is None


def test_answer_from_nobody_is_unknown_and_answers_name_their_helper():
    verdict = verdict_of([DialBackAnswer("h", "/ip4/203.0.113.7/tcp/1", [("/ip4/203.0.113.7/tcp/4001", False, "x")])],
                         2, ["/ip4/10.0.0.2/tcp/4001"])
    assert verdict.reachable is False and verdict.public_ip == "203.0.113.7" and verdict.ports == [4001]


HELPER_ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


@in_loop
async def test_join_check_logs_one_line_and_the_status_record_carries_it(caplog, tmp_path):
    import logging

    from peerd.config import NodeConfig
    from peerd.roles.status_board import StatusBoard
    from peerd.status.records import dialable_peers
    from peerd.transport.dialback import watch_reachability

    hub = Hub()
    me, helper = hub.transport(ME), hub.transport(HELPER_ID)
    me.visible_maddrs = lambda: ["/ip4/127.0.0.1/tcp/4001/p2p/" + ME]

    async def answers(peer, addrs, timeout_s):
        return {a: (True, "connected") for a in addrs}

    service = DialBackService(answers, observed=lambda peer: "/ip4/127.0.0.1/tcp/50000")
    await service.start(helper)
    board = StatusBoard(me.discovery, "peerd.r.status", ME, 1.0, 5.0, asyncio.Event())
    node = NodeConfig(initial_peers=(f"/ip4/127.0.0.1/tcp/1/p2p/{HELPER_ID}",), checkpoint_dir=str(tmp_path))
    try:
        with caplog.at_level(logging.INFO, logger="peerd.transport.dialback"):
            verdict = await watch_reachability(me, node, dialable_peers(me.discovery, board.key),
                                               on_verdict=lambda v: setattr(board, "reachable", v.reachable))
        lines = [r.getMessage() for r in caplog.records if getattr(r, "event", None) == "reachability"]
        assert lines == ["reachable: other peers can dial this peer at /ip4/127.0.0.1/tcp/4001 (checked by 1 peer(s))"]
        assert verdict.reachable is True
        await board.publish()
        assert (await board.records())[ME]["reachable"] is True
        caplog.clear()
        lonely = NodeConfig(checkpoint_dir=str(tmp_path))  # nobody to ask: unknown, asked again, logged twice
        with caplog.at_level(logging.INFO, logger="peerd.transport.dialback"):
            verdict = await watch_reachability(me, lonely, None, recheck_s=(0.01, 0.01))
        assert verdict.reachable is None
        assert [r.getMessage()[:22] for r in caplog.records
                if getattr(r, "event", None) == "reachability"] == ["reachability unknown: "] * 2
    finally:
        await service.stop()


RELAY_ID = "12D3KooWRelay"


def test_relays_of_takes_the_relay_part_of_circuit_addresses():
    addrs = ["/ip4/192.168.1.5/tcp/4001/p2p/" + ME,
             f"/ip4/192.0.0.65/tcp/31337/p2p/{RELAY_ID}/p2p-circuit/p2p/{ME}",
             f"/ip4/192.0.0.65/tcp/31337/p2p/{RELAY_ID}/p2p-circuit",
             f"/ip4/198.51.100.2/tcp/1/p2p/{RELAY_ID}2/p2p-circuit/p2p/{ME}"]
    assert relays_of(addrs) == [f"/ip4/192.0.0.65/tcp/31337/p2p/{RELAY_ID}", f"/ip4/198.51.100.2/tcp/1/p2p/{RELAY_ID}2"]
    assert relays_of(addrs[:1]) == [] and relays_of(["/p2p-circuit"]) == []


@in_loop
async def test_an_unreachable_peer_waits_for_its_relay_slot_and_the_line_names_the_relay():
    hub = Hub()
    me, helper = hub.transport(ME), hub.transport("helper")

    async def never(peer, addrs, timeout_s):
        return {a: (False, "no answer") for a in addrs}

    service = DialBackService(never, observed=lambda peer: "/ip4/81.2.69.160/tcp/50000")
    await service.start(helper)
    direct = "/ip4/192.168.1.5/tcp/4001/p2p/" + ME
    circuit = f"/ip4/81.2.69.1/tcp/31337/p2p/{RELAY_ID}/p2p-circuit/p2p/{ME}"
    polls = []

    def addrs():  # the relay slot arrives on the third look
        polls.append(1)
        return [direct] + ([circuit] if len(polls) >= 3 else [])

    me.visible_maddrs = addrs
    try:
        verdict = await check_transport(me, ["helper"], relay="auto", relay_wait_s=10.0)
        assert verdict.reachable is False and verdict.relayed is True
        assert verdict.relays == [f"/ip4/81.2.69.1/tcp/31337/p2p/{RELAY_ID}"]
        line = verdict.line()
        assert line.startswith(f"not directly reachable; reachable through relay /ip4/81.2.69.1/tcp/31337/p2p/{RELAY_ID} "
                               "(slower"), line
        assert "for direct connections forward TCP port 4001" in line and "/ip4/81.2.69.160/tcp/4001" in line
        polls.clear()
        me.visible_maddrs = lambda: polls.append(1) or [direct]
        started = asyncio.get_running_loop().time()
        alone = await check_transport(me, ["helper2"], relay="auto", relay_wait_s=10.0)  # nobody answers: no wait
        assert alone.reachable is None and not alone.relayed and asyncio.get_running_loop().time() - started < 5
        service.limiter.per_peer_interval_s = 0.0
        off = await check_transport(me, ["helper"], relay="off", relay_wait_s=10.0)  # relays off: no wait
        assert off.reachable is False and not off.relayed and off.line().startswith("not reachable")
        assert len(polls) == 4  # two looks per check (what to dial, then the relays), no waiting
    finally:
        await service.stop()
