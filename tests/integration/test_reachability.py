"""The dial-back check on real p2pd nodes: a helper (a bootstrap-like DHT node serving the check) dials a doctor's
node back through a fresh p2pd, and the dialer reports a closed port and another PeerID as unreachable.

Network: DHT nodes and p2pd daemons on 127.0.0.1 only; run the module inside a loopback-only namespace
(``unshare -n``).
"""

from __future__ import annotations

import asyncio

import pytest

from peerd.config import NodeConfig
from peerd.daemon import serve_dialback
from peerd.commands.doctor import network_checks
from peerd.transport.dialback import p2pd_dial
from peerd.transport.hivemind_backend import HivemindTransport
from tests.ports import closed_port

pytestmark = pytest.mark.timeout(120)


def test_doctor_is_dialed_back_and_the_dialer_tells_closed_ports_and_wrong_peers(tmp_path):
    async def main():
        helper = await HivemindTransport.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], relay="auto")
        service = await serve_dialback(helper)
        try:
            maddr = helper.visible_maddrs()[0]
            node = NodeConfig(initial_peers=(maddr,), host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                              checkpoint_dir=str(tmp_path / "ckpt"))
            checks = {c.name: c for c in await network_checks(node, "reach-demo", identity_dir=str(tmp_path))}
            assert checks["bootstrap"].ok, checks["bootstrap"].line()
            assert not checks["run"].ok and "no configuration" in checks["run"].detail
            assert checks["reachable"].ok and checks["reachable"].detail.startswith(
                "reachable: other peers can dial this peer at /ip4/127.0.0.1/tcp/"), checks["reachable"].line()
            assert checks["clock"].ok
            assert service.checks == 1

            real = "/".join(maddr.split("/")[:5])
            closed = f"/ip4/127.0.0.1/tcp/{await closed_port()}"
            found = await p2pd_dial(helper.peer_id, [closed, real], timeout_s=5.0)
            assert found[closed][0] is False and found[real][0] is True, found
            other = await HivemindTransport.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], relay="off")
            try:  # the address answers, but with another key: not the peer that asked
                found = await p2pd_dial(other.peer_id, [real], timeout_s=5.0)
                assert found[real][0] is False, found
            finally:
                await other.shutdown()
        finally:
            await service.stop()
            await helper.shutdown()

    asyncio.run(main())
