"""The dial-back check across a real NAT: a peer in a LAN namespace behind a masquerading router namespace (no
inbound: the router drops new connections from the outside) is told it is not reachable, and the helper reports
the router's address as the one the request came from (the reachable case on real p2pd nodes is in
tests/integration/test_reachability.py). Needs root and iptables (scripts/setup installs it as root).

Topology (addresses exist only in the namespaces made here)::

    NAME-pub [pub0 10.89.0.1/24] ==veth== [wan0 10.89.0.2/24] NAME-rtr [in0 192.168.77.1/24] ==veth== [lan0 192.168.77.2/24] NAME-lan
                                            MASQUERADE out of wan0; wan0 -> in0 only for established connections
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]

#: The helper: a DHT node serving the dial-back check with a short dial timeout (the router drops, so each dial to
#: the NAT peer waits it out). Prints its multiaddr, then serves until stdin closes.
HELPER = textwrap.dedent("""
    import asyncio, sys
    from peerd.transport.dialback import observed_addr, p2pd_dial
    from peerd.transport.hivemind_backend import HivemindTransport
    from protocols.reachability import DialBackService

    async def main():
        t = await HivemindTransport.create(host_maddrs=["/ip4/10.89.0.1/tcp/0"], relay="off")
        service = DialBackService(p2pd_dial, observed=lambda peer: observed_addr(t, peer), dial_timeout_s=2.0)
        await service.start(t)
        print(t.visible_maddrs()[0], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await service.stop()
        await t.shutdown()

    asyncio.run(main())
""")

#: An asker: joins through the helper, listening on every interface, and prints the verdict's line.
ASKER = textwrap.dedent("""
    import asyncio, sys
    from peerd.transport.dialback import check_transport, peer_of
    from peerd.transport.hivemind_backend import HivemindTransport

    async def main():
        t = await HivemindTransport.create(initial_peers=[sys.argv[1]], host_maddrs=["/ip4/0.0.0.0/tcp/0"],
                                           relay="off")
        try:
            verdict = await check_transport(t, [peer_of(sys.argv[1])], relay="off")
            print(verdict.reachable, verdict.public_ip, flush=True)
            print(verdict.line(), flush=True)
        finally:
            await t.shutdown()

    asyncio.run(main())
""")


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


@pytest.fixture
def nat():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    assert shutil.which("iptables"), "iptables is missing: scripts/setup installs it (apt-get install iptables)"
    name = f"rn{os.getpid() % 10**6}"
    pub, rtr, lan = f"{name}-pub", f"{name}-rtr", f"{name}-lan"
    try:
        for ns in (pub, rtr, lan):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "link", "add", "pub0", "netns", pub, "type", "veth", "peer", "name", "wan0", "netns", rtr)
        _sh("ip", "link", "add", "lan0", "netns", lan, "type", "veth", "peer", "name", "in0", "netns", rtr)
        for ns, dev, addr in ((pub, "pub0", "10.89.0.1/24"), (rtr, "wan0", "10.89.0.2/24"),
                              (rtr, "in0", "192.168.77.1/24"), (lan, "lan0", "192.168.77.2/24")):
            _sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", lan, "route", "add", "default", "via", "192.168.77.1")
        _sh("ip", "netns", "exec", rtr, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _sh("ip", "netns", "exec", rtr, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j",
            "MASQUERADE")
        _sh("ip", "netns", "exec", rtr, "iptables", "-A", "FORWARD", "-i", "wan0", "-o", "in0", "-m", "state",
            "--state", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _sh("ip", "netns", "exec", rtr, "iptables", "-A", "FORWARD", "-i", "wan0", "-o", "in0", "-j", "DROP")
        yield pub, lan
    finally:
        for ns in (pub, rtr, lan):
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _python(ns: str, code: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, "env", f"PYTHONPATH={ROOT}", sys.executable, "-c", code, *args]


def test_a_peer_behind_nat_is_told_it_is_unreachable_with_the_routers_address(nat):
    pub, lan = nat
    helper = subprocess.Popen(_python(pub, HELPER), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        maddr = helper.stdout.readline().strip()
        assert maddr.startswith("/ip4/10.89.0.1/tcp/"), maddr
        behind = subprocess.run(_python(lan, ASKER, maddr), capture_output=True, text=True, timeout=180)
        assert behind.returncode == 0, behind.stderr[-2000:]
        found, line = behind.stdout.splitlines()[:2]
        assert found == "False 10.89.0.2", behind.stdout  # the router's address: what the helper saw
        assert line.startswith("not reachable: no peer could dial this peer back; forward TCP port "), line
    finally:
        helper.stdin.close()
        try:
            helper.wait(20)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait()
