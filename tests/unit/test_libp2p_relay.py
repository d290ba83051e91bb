"""When the py-libp2p daemon reserves circuit relay slots (it has no AutoNAT: the listen addresses decide), and the
addresses it announces for them."""

import socket

import pytest

from peerd.transport.libp2p_relay import circuit_addr, concrete_addrs, wants_reservation

pytestmark = pytest.mark.timeout(30)


def test_auto_reserves_only_without_a_public_listen_ip():
    lan = ["/ip4/192.168.1.20/tcp/4001", "/ip4/127.0.0.1/tcp/4001"]
    assert wants_reservation("auto", lan)
    assert wants_reservation("auto", ["/ip4/10.0.0.7/tcp/1", "/ip4/100.64.3.1/tcp/1", "/ip6/fd00::1/tcp/1"])
    assert not wants_reservation("auto", [*lan, "/ip4/8.8.4.4/tcp/4001"])  # a public address: dialable
    assert not wants_reservation("auto", ["/ip4/127.0.0.1/tcp/4001"])  # loopback only: tests, the local demo
    assert not wants_reservation("auto", ["/ip4/0.0.0.0/tcp/4001", "/dns4/example.org/tcp/1", "/ip4/x/tcp/1"])
    assert wants_reservation("always", ["/ip4/8.8.4.4/tcp/4001"])
    assert not wants_reservation("off", lan)
    with pytest.raises(ValueError, match="relay must be one of"):
        wants_reservation("sometimes", lan)


def test_wildcard_listeners_become_the_ip_that_reaches_the_relays():
    relay = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWRelay"
    assert concrete_addrs(["/ip4/192.168.1.20/tcp/1"], [relay]) == ["/ip4/192.168.1.20/tcp/1"]
    assert concrete_addrs(["/ip4/0.0.0.0/tcp/1"], [relay]) == ["/ip4/127.0.0.1"]  # the route to the relay
    assert concrete_addrs(["/ip4/0.0.0.0/tcp/1"], ["/dns4/relay.example/tcp/1/p2p/X"]) == []  # no IP to route
    if socket.has_ipv6:
        assert concrete_addrs(["/ip6/::/tcp/1"], ["/ip6/::1/tcp/4001/p2p/X"]) in (["/ip6/::1"], [])


def test_circuit_address_through_a_relay():
    assert circuit_addr("/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWRelay") == \
        "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWRelay/p2p-circuit"
