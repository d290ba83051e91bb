"""The DHT node in the daemon's own event loop (node config ``dht = "inline"``) next to the default child-process DHT,
and workers forked from a preloaded process (``Swarm(preload=True)``): real p2pd daemons and real peer processes on
127.0.0.1 (run inside a loopback-only namespace, as ``scripts/test`` does)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from peerd.testing.localswarm import TINY, Swarm, warm_preload
from peerd.transport.hivemind_backend import HivemindTransport
from peerd.transport.hivemind_dht import InlineDHT
from protocols.rpc import Service, call

pytestmark = pytest.mark.timeout(180)


class _Echo(Service):
    name = "t"

    async def rpc_echo(self, request):
        return {"n": request.size}, await request.payload(1 << 20)


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether process ``pid`` has exited (or is a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_an_inline_peer_and_a_process_peer_share_records_and_streams_and_shut_down_clean():
    async def main():
        first = await HivemindTransport.create(nat_port_map=False)
        inline = await HivemindTransport.create(initial_peers=first.visible_maddrs(), nat_port_map=False, dht="inline")
        try:
            assert isinstance(inline.dht, InlineDHT) and inline.visible_maddrs()[0].endswith(inline.peer_id)
            now = first.discovery.time()
            assert await first.discovery.store("inline-key", "from-process", b"a", now + 60)
            assert await inline.discovery.store("inline-key", "from-inline", b"b", now + 60)
            seen = [{k: r.value for k, r in (await t.discovery.get("inline-key")).items()} for t in (first, inline)]
            await _Echo().start(inline)
            reply = await call(first.streams, inline.peer_id, "t", "echo", {}, b"x" * 100_000, timeout_s=30,
                               max_reply_bytes=1 << 20)
            p2pd = psutil.Process(inline.dht.p2p._child.pid)
            assert "p2pd" in p2pd.name() and p2pd.ppid() == os.getpid()  # our own child: no DHT process between
        finally:
            await inline.shutdown()
            await first.shutdown()
        return seen, reply, p2pd.pid

    seen, reply, p2pd = asyncio.run(main())
    assert seen == [{"from-process": b"a", "from-inline": b"b"}] * 2
    assert reply.header == {"n": 100_000} and bytes(reply.payload) == b"x" * 100_000
    assert _gone(p2pd), "shutdown left the inline p2pd running"


_HOLDER = textwrap.dedent("""
    import asyncio, sys
    from peerd.transport.hivemind_backend import HivemindTransport

    async def main():
        t = await HivemindTransport.create(nat_port_map=False, dht="inline")
        print(t.dht.p2p._child.pid, flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def test_the_inline_p2pd_stops_when_its_daemon_is_sigkilled():
    """Nothing runs in a SIGKILLed process, yet its p2pd must not outlive it (the watchdog stops it; p2pd also exits
    on its next write to the dead daemon's output pipe, so a p2pd that logs covers for a missing watchdog)."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        p2pd = int(holder.stdout.readline())
        assert "p2pd" in psutil.Process(p2pd).name() and not _gone(p2pd, 0.5)
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        assert _gone(p2pd), "p2pd outlived its SIGKILLed daemon"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)  # the watchdog and p2pd too, whatever happened


@pytest.mark.slow
def test_preloaded_inline_workers_and_a_default_worker_train_together(tmp_path):
    """Two workers forked from the preloaded process with ``--dht inline`` and one started the default way (fresh
    interpreter, DHT child process) form one run: same groups, bit-identical theta_outer."""
    forked = Swarm(tmp_path / "forked", preload=True)
    plain = Swarm(tmp_path / "plain")
    (tmp_path / "forked").mkdir()
    (tmp_path / "plain").mkdir()
    try:
        plain.start_bootstrap()
        forked.bootstrap_maddr = plain.bootstrap_maddr
        warm_preload()
        config = tmp_path / "run.toml"  # rounds of 30 steps: the forked workers start within one
        config.write_text(TINY.read_text().replace("inner_steps = 10", "inner_steps = 30"))
        creator = plain.start_peer("default", "mixed", config)
        # a forked worker starts in about a second, a fresh interpreter in several: the creator gets that head start
        plain.wait_for(lambda: bool(creator.of("config_published")), 90, "the run's config")
        peers = [forked.start_peer(f"inline{i}", "mixed", None, "--dht", "inline") for i in range(2)] + [creator]
        for swarm, peer in zip((forked, forked, plain), peers):
            assert swarm.wait_exit(peer, 150) == 0, plain.tails() + forked.tails()
        assert [isinstance(p.proc, subprocess.Popen) for p in peers] == [False, False, True]
        for round_ in (1, 2):
            digests = {p.digests().get(round_) for p in peers}
            assert len(digests) == 1 and None not in digests, (round_, digests)
        sizes = [e["group_size"] for p in peers for e in p.of("outer_round")]
        assert sizes and max(sizes) == 3, sizes
    finally:
        forked.close()
        plain.close()
