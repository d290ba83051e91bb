"""A peer behind a real NAT: a peer in a LAN namespace behind a masquerading router namespace (no inbound: the router
drops new connections from the outside) is told it is not directly reachable (the helper reports the router's
address as the one the request came from), gets a circuit relay reservation on the helper (its initial peer, with
``relay = "auto"`` on both), and a reachable peer dials it through the relay and exchanges bytes over an RPC; its
verdict line names the relay. The reachable case on real p2pd nodes is in tests/integration/test_reachability.py.
Needs root and iptables (scripts/setup installs it as root).

Topology (addresses exist only in the namespaces made here; no namespace has a route beyond them)::

    NAME-pub [pub0 192.0.0.65/29] ==veth== [wan0 192.0.0.66/29] NAME-rtr [in0 192.168.77.1/24] ==veth== [lan0 192.168.77.2/24] NAME-lan
                                            MASQUERADE out of wan0; wan0 -> in0 only for established connections

Why 192.0.0.64/29 on the "public" side: go-libp2p (v0.32, in hivemind's p2pd) relays only between public addresses
as go-multiaddr's ``manet.IsPublicAddr`` defines them (not in 10/8, 100.64/10, 172.16/12, 192.168/16, 127/8,
169.254/16, nor in its unroutable list, which holds the TEST-NETs and 192.0.0.0/26 but not the rest of 192.0.0.0/24):
its AutoNAT server dials back only public addresses and its client asks only peers with public addresses (so with
private ones a NATed peer never learns it is private and never looks for a relay), the relay puts only its public
addresses in a reservation, and auto-relay builds ``/p2p-circuit`` addresses only from a relay's public addresses.
192.0.0.64/29 passes that test yet is IETF protocol-assignment space that no real host uses, and the packets never
leave these namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.xdist_group("netns"), pytest.mark.timeout(1200)]  # ~120 s quiet

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "node_configs" / "machines" / "local-test.toml"
#: The reachable side ("public" to go-libp2p, see the module docstring) and the router's address on it.
PUBLIC_IP, ROUTER_IP, PUBLIC_PREFIX = "192.0.0.65", "192.0.0.66", 29
#: A second address of the reachable side that the router does not let the LAN reach (a peer behind a firewall).
FAR_IP = "192.0.0.67"

#: The helper and relay: a DHT node with relays on, serving the dial-back check with a short dial timeout (the
#: router drops, so each dial to the NAT peer waits it out). Prints its multiaddr, then serves until stdin closes.
HELPER = textwrap.dedent(f"""
    import asyncio, sys
    from peerd.transport.dialback import observed_addr, p2pd_dial
    from peerd.transport.hivemind_backend import HivemindTransport
    from protocols.reachability import DialBackService

    async def main():
        t = await HivemindTransport.create(host_maddrs=["/ip4/{PUBLIC_IP}/tcp/0"], relay="auto")
        service = DialBackService(p2pd_dial, observed=lambda peer: observed_addr(t, peer), dial_timeout_s=2.0)
        await service.start(t)
        print(t.visible_maddrs()[0], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await service.stop()
        await t.shutdown()

    asyncio.run(main())
""")

#: The peer behind the NAT: joins through the helper (its relay) listening on every interface, serves an echo RPC
#: that also says which address the request came from, and prints the verdict, its line and its circuit address;
#: serves until stdin closes.
NATED = textwrap.dedent("""
    import asyncio, sys, time
    from peerd.transport.dialback import check_transport, observed_addr, peer_of, visible_addrs
    from peerd.transport.hivemind_backend import HivemindTransport
    from protocols.rpc import Service

    class Echo(Service):
        name = "test.echo"

        async def rpc_echo(self, request):
            data = await request.payload(16 << 20)
            return {"via": observed_addr(t, request.peer)}, bytes(data[::-1])

    async def main():
        global t
        started = time.monotonic()
        relay = (await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)).strip()
        if sys.argv[1] == "libp2p":
            from peerd.transport.libp2p_backend import LibP2PTransport as cls
        else:
            cls = HivemindTransport
        t = await cls.create(initial_peers=[relay], host_maddrs=["/ip4/0.0.0.0/tcp/0"], relay="auto")
        try:
            await Echo().start(t)
            print(f"started in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
            verdict = await check_transport(t, [peer_of(relay)], relay="auto")
            print(f"verdict after {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
            print(verdict.reachable, verdict.relayed, verdict.public_ip, flush=True)
            print(verdict.line(), flush=True)
            print(next((a for a in await visible_addrs(t) if "/p2p-circuit" in a), None), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        finally:
            await t.shutdown()

    asyncio.run(main())
""")

#: Two reachable peers without a DHT (bare p2pd nodes), one at NEAR_IP (the NATed peer can dial it: DCUtR's
#: connection reversal replaces the relayed connection by a direct one) and one at FAR_IP (the router drops
#: connections from the LAN to it: only the relay joins them). Prints "ready", reads the NATed peer's circuit
#: address from stdin, then each dials it through the relay and calls its echo RPC with payloads of the sizes given;
#: one line per call: name, size, intact, the address the NATed peer saw the request come from, seconds.
DIALER = textwrap.dedent(f"""
    import asyncio, os, sys, time
    from hivemind.p2p import P2P
    from peerd.transport.hivemind_backend import HivemindStreams, relay_options
    from protocols.rpc import call

    async def main():
        read = lambda: asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        relay = (await read()).strip()
        peers = {{}}
        try:
            nodes = await asyncio.gather(*(P2P.create(initial_peers=[relay], host_maddrs=[f"/ip4/{{ip}}/tcp/0"],
                                                      nat_port_map=False, **relay_options("auto", client_mode=True))
                                           for ip in ("{PUBLIC_IP}", "{FAR_IP}")))
            peers = {{name: HivemindStreams(p2p) for name, p2p in zip(("near", "far"), nodes)}}
            print("ready", flush=True)
            circuit = (await read()).strip()
            target = circuit.rsplit("/p2p/", 1)[1]
            for name, streams in peers.items():
                await streams.connect(circuit)
                for size in map(int, sys.argv[1:]):
                    payload = os.urandom(size)
                    started = time.monotonic()
                    reply = await call(streams, target, "test.echo", "echo", {{}}, payload, timeout_s=60,
                                       max_reply_bytes=size + (1 << 16))
                    ok = bytes(reply.payload) == payload[::-1]
                    print(name, size, ok, reply.header.get("via"), round(time.monotonic() - started, 2), flush=True)
        finally:
            for streams in peers.values():
                await streams.p2p.shutdown()

    asyncio.run(main())
""")


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=120)  # a safety net: instant on a quiet machine


@pytest.fixture
def nat():
    assert shutil.which("iptables"), "iptables is missing: scripts/setup installs it (apt-get install iptables)"
    name = f"rn{os.getpid() % 10**6}"
    pub, rtr, lan = f"{name}-pub", f"{name}-rtr", f"{name}-lan"
    try:
        for ns in (pub, rtr, lan):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "link", "add", "pub0", "netns", pub, "type", "veth", "peer", "name", "wan0", "netns", rtr)
        _sh("ip", "link", "add", "lan0", "netns", lan, "type", "veth", "peer", "name", "in0", "netns", rtr)
        for ns, dev, addr in ((pub, "pub0", f"{PUBLIC_IP}/{PUBLIC_PREFIX}"), (rtr, "wan0", f"{ROUTER_IP}/{PUBLIC_PREFIX}"),
                              (rtr, "in0", "192.168.77.1/24"), (lan, "lan0", "192.168.77.2/24")):
            _sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", lan, "route", "add", "default", "via", "192.168.77.1")
        for ns in (pub, rtr):  # nothing routes beyond the namespaces made here
            routes = subprocess.run(["ip", "-n", ns, "route", "show", "default"], capture_output=True, text=True)
            assert routes.stdout.strip() == "", routes.stdout
        _sh("ip", "netns", "exec", rtr, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _sh("ip", "netns", "exec", rtr, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j",
            "MASQUERADE")
        _sh("ip", "netns", "exec", rtr, "iptables", "-A", "FORWARD", "-i", "wan0", "-o", "in0", "-m", "state",
            "--state", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _sh("ip", "netns", "exec", rtr, "iptables", "-A", "FORWARD", "-i", "wan0", "-o", "in0", "-j", "DROP")
        _sh("ip", "-n", pub, "addr", "add", f"{FAR_IP}/{PUBLIC_PREFIX}", "dev", "pub0")
        _sh("ip", "netns", "exec", rtr, "iptables", "-A", "FORWARD", "-i", "in0", "-o", "wan0", "-d", FAR_IP, "-j",
            "DROP")
        yield pub, lan
    finally:
        for ns in (pub, rtr, lan):
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _python(ns: str, code: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, "env", f"PYTHONPATH={ROOT}", sys.executable, "-c", code, *args]


def _start(ns: str, code: str, *args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(_python(ns, code, *args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True)


def _tell(proc: subprocess.Popen, line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _stop(*procs: subprocess.Popen) -> None:
    """Close every process's stdin (each then shuts down), then wait for them all."""
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("backend", ["p2pd", "libp2p"])
def test_a_peer_behind_nat_is_unreachable_and_reached_through_a_relay(backend, nat, tmp_path):
    """The NATed peer runs either transport; the relay and the dialers are p2pd peers (py-libp2p's circuit relay v2
    client reserves its slot on the p2pd relay). The near dialer may reach it directly (on p2pd through DCUtR, on
    py-libp2p over a connection the NATed peer's Kademlia opened to it); the far one only through the relay."""
    pub, lan = nat
    started = time.monotonic()
    logs = {name: tmp_path / f"{name}.log" for name in ("helper", "dialer", "nated")}
    # all three start at once (most of their start-up is Python imports); each waits on stdin for what it needs
    helper = _start(pub, HELPER, log=logs["helper"])
    dialer = _start(pub, DIALER, str(64 << 10), str(4 << 20), log=logs["dialer"])
    nated = _start(lan, NATED, backend, log=logs["nated"])
    procs = [helper, dialer, nated]
    try:
        maddr = helper.stdout.readline().strip()
        assert maddr.startswith(f"/ip4/{PUBLIC_IP}/tcp/"), logs["helper"].read_text()[-2000:]
        print(f"relay up after {time.monotonic() - started:.1f} s")
        # the dialers connect to the relay first: one of them (another public IP) answers its AutoNAT probe, and a
        # relay that knows it is public serves with the configured limits (see the module docstring)
        _tell(dialer, maddr)
        assert dialer.stdout.readline().strip() == "ready", logs["dialer"].read_text()[-3000:]
        print(f"dialers ready after {time.monotonic() - started:.1f} s")
        _tell(nated, maddr)
        found, line, circuit = (nated.stdout.readline().strip() for _ in range(3))
        print(f"verdict after {time.monotonic() - started:.1f} s: {line}")
        assert found == f"False True {ROUTER_IP}", (found, logs["nated"].read_text()[-3000:])
        assert line.startswith(f"not directly reachable; reachable through relay {maddr} (slower"), line
        assert "for direct connections forward TCP port " in line, line
        assert circuit.startswith(f"{maddr}/p2p-circuit/p2p/"), circuit
        _tell(dialer, circuit)
        for name in ("near", "far"):
            for size in (64 << 10, 4 << 20):
                answer = dialer.stdout.readline().split()
                print(f"{time.monotonic() - started:.1f} s: {answer}")
                assert answer[:3] == [name, str(size), "True"], (answer, logs["dialer"].read_text()[-3000:])
                if name == "far":  # only the relay joins them: the request came through it (the py-libp2p
                    # daemon names a relayed stream's remote by the relay's own transport address)
                    via = f"{maddr}/p2p-circuit" if backend == "p2pd" else maddr.split("/p2p/")[0]
                    assert answer[3] == via, answer
        assert dialer.wait(30) == 0
    finally:
        _stop(*procs)
        print(f"stopped after {time.monotonic() - started:.1f} s")


#: All-reduces in groups that the NATed worker ran in rounds it started after its verdict, before the test stops the
#: workers (at least one of those rounds, or a later one, averaged all three).
AFTER_VERDICT = 2


def _join(ns: str, name: str, host: str, bootstrap: str, run: Path, tmp_path: Path) -> subprocess.Popen:
    """``peerd join`` in namespace ``ns`` listening on ``host`` (JSON events to ``<name>.log``)."""
    argv = ["ip", "netns", "exec", ns, "env", f"PYTHONPATH={ROOT}", "PEERD_LOGLEVEL=INFO", sys.executable, "-m",
            "peerd", "join", "--run-id", "nat", "--run-config", str(run), "--config", str(LOCAL),
            "--log-format", "json", "--identity", str(tmp_path / f"{name}.key"),
            "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"), "--initial-peers", bootstrap, "--host-maddrs", host]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{name}.log").open("w"))


def _events(log: Path, event: str) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == event:
                out.append(record)
    return out


def _after_verdict(logs: dict[str, Path]) -> tuple[Optional[float], list[dict], list[int]]:
    """From the workers' logs so far: when the NATed worker learned it is not reachable but relayed (None before),
    its all-reduces in groups in the rounds it started after that, and those rounds in which all three averaged
    together (every worker completed it in a group of 3)."""
    verdict = _events(logs["nated"], "reachability")
    if not verdict or verdict[-1]["reachable"] is not False:
        return None, [], []
    known_at = verdict[-1]["time"]
    progress = sorted(e["time"] for kind in ("outer_round", "state_download") for e in _events(logs["nated"], kind))
    after = [e for e in _events(logs["nated"], "allreduce") if e["group_size"] > 1
             and max((p for p in progress if p < e["time"]), default=0.0) > known_at]
    rounds = {name: {e["outer_round"]: e for e in _events(log, "outer_round")} for name, log in logs.items()}
    trio = [k for k, e in rounds["nated"].items() if e["time"] > known_at and e["group_size"] == 3
            and all(rounds[n].get(k, {}).get("group_size") == 3 for n in ("pub0", "pub1"))]
    return known_at, after, trio


@pytest.mark.long
def test_a_diloco_worker_behind_nat_trains_with_reachable_workers_and_reduces_nothing(nat, tmp_path):
    """Three ``peerd join`` workers and a bootstrap node (default relay = "auto"): ``pub0`` and ``pub1`` on the
    reachable side, ``nated`` behind the router. The NATed worker is found not reachable but relayed (``peerd
    doctor`` run on its machine meanwhile says so in an OK line), and in the
    rounds it starts after that it leads no group and reduces no part: its rounds' streams are all its own; groups
    of all three hold one theta_outer after their round. The workers are stopped (SIGTERM) once the NATed worker ran
    AFTER_VERDICT such all-reduces. (Both reachable workers listen on PUBLIC_IP: a second IP
    of the same namespace would reach the helper from PUBLIC_IP, the kernel's source for local traffic, and be
    found unreachable.)"""
    pub, lan = nat
    started = time.monotonic()
    text = (ROOT / "node_configs" / "runs" / "tiny-test.toml").read_text()
    # short rounds (20 inner steps: the round's CPU is the matchmaking's, not the training's); the verdict comes 2-13 s
    # after the first evaluation; the test stops the workers once enough rounds started after it (max_outer_rounds
    # is a safety net)
    for key, value in (("max_outer_rounds", 100), ("inner_steps", 20)):
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    run = tmp_path / "run.toml"
    run.write_text(text)
    boot_out = (tmp_path / "bootstrap.out").open("w")
    bootstrap = subprocess.Popen(
        ["ip", "netns", "exec", pub, "env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "peerd", "bootstrap",
         "--config", str(LOCAL), "--identity", str(tmp_path / "bootstrap.key"), "--checkpoint-dir",
         str(tmp_path / "bootstrap-state"), "--host-maddrs", f"/ip4/{PUBLIC_IP}/tcp/0"],
        stdout=boot_out, stderr=(tmp_path / "bootstrap.err").open("w"))
    workers: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"{name}.log" for name in ("pub0", "pub1", "nated")}
    try:
        deadline = time.monotonic() + 90
        while not (maddrs := [l for l in (tmp_path / "bootstrap.out").read_text().splitlines() if "/p2p/" in l]):
            assert time.monotonic() < deadline and bootstrap.poll() is None, (tmp_path / "bootstrap.err").read_text()
            time.sleep(0.2)
        boot = maddrs[0].strip()
        for name, ns, host in (("pub0", pub, PUBLIC_IP), ("pub1", pub, PUBLIC_IP), ("nated", lan, "0.0.0.0")):
            workers[name] = _join(ns, name, f"/ip4/{host}/tcp/0", boot, run, tmp_path)
        # `peerd doctor` on the NATed machine while the run trains: its reachable line says relayed
        doctor = subprocess.run(
            ["ip", "netns", "exec", lan, "env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "peerd", "doctor",
             "--run-id", "nat", "--config", str(LOCAL), "--initial-peers", boot, "--host-maddrs", "/ip4/0.0.0.0/tcp/0",
             "--identity", str(tmp_path / "doctor.key")],
            capture_output=True, text=True, timeout=400)  # a safety net: on a quiet machine it answers in ~20 s
        reach = [line for line in doctor.stdout.splitlines() if " reachable " in f" {line} "]
        assert reach and reach[0].startswith("OK") and "reachable through relay" in reach[0], doctor.stdout
        print(f"doctor after {time.monotonic() - started:.1f} s: {reach[0]}")
        deadline = time.monotonic() + 600  # a safety net: ~15 s on a quiet machine, ~50 s beside 6 busy loops
        while len((seen := _after_verdict(logs))[1]) < AFTER_VERDICT or not seen[2]:
            for name, proc in workers.items():
                assert proc.poll() is None, (name, proc.returncode, logs[name].read_text()[-3000:])
            assert time.monotonic() < deadline, {name: log.read_text()[-1500:] for name, log in logs.items()}
            time.sleep(1.0)
        for proc in workers.values():
            proc.terminate()
        for name, proc in workers.items():
            assert proc.wait(120) == 0, (name, logs[name].read_text()[-3000:])
        print(f"workers stopped after {time.monotonic() - started:.1f} s")
    finally:
        for proc in [*workers.values(), bootstrap]:
            if proc.poll() is None:
                proc.terminate()
        for proc in [*workers.values(), bootstrap]:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    verdict = _events(logs["nated"], "reachability")
    assert verdict and verdict[-1]["reachable"] is False and verdict[-1]["relayed"] is True, verdict
    assert all(_events(log, "leave") for log in logs.values()), {n: log.read_text()[-1500:] for n, log in logs.items()}
    # in the rounds it started once it knew, the NATed worker reduced nothing in a group (alone it reduces its whole
    # vector) ...
    known_at, after, trio = _after_verdict(logs)
    assert after and all(e["part_numel"] == 0 for e in after), (known_at, after)
    # ... and averaged with both others, ending those rounds with the same theta_outer as they did
    rounds = {name: {e["outer_round"]: e for e in _events(log, "outer_round")} for name, log in logs.items()}
    sizes = {name: {k: e["group_size"] for k, e in r.items()} for name, r in rounds.items()}
    assert len(after) >= AFTER_VERDICT and trio, sizes
    assert all(len({rounds[n][k]["digest"] for n in rounds}) == 1 for k in trio), rounds
    print(f"nated: verdict {known_at - min(e['time'] for e in _events(logs['nated'], 'eval')):.1f} s after its first "
          f"eval; {len(after)} all-reduces after it, part 0 in each; rounds in a group of 3 with one theta_outer: "
          f"{trio}; failed rounds: " + ", ".join(f"{n} {len(_events(log, 'round_failed'))}" for n, log in logs.items()))
