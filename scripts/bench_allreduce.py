#!/usr/bin/env python
"""Benchmark: peerd's averaging (Matchmaker + ButterflyAllReduce on HivemindTransport) vs hivemind's
DecentralizedAverager vs torch.distributed gloo all_reduce, on the virtual WAN of scripts/wan_testbed. Needs root.

Every peer is its own process (its own DHT child and p2pd for peerd and hivemind) inside its own network namespace,
shaped by tbf; the loopback scenario runs all peers in one namespace of ours on 127.0.0.1 (no shaping), where the
ratio to gloo shows pure software overhead. Each peer averages S bytes of fp32 (default 25 MB), weight rank + 1.

Per repetition, the driver tells all peers "go" at once and each peer reports wall-clock timestamps (one machine,
one clock): the all-reduce time is ``max(end) - min(start)`` over peers, where start is when the peer had its group
(peerd: ``Matchmaker.form_group`` returned; hivemind: its step reached AWAITING_TRIGGER, then we trigger it; gloo:
after a barrier); matchmaking time (median over peers, from "go" to having the group) is reported separately. The
first repetition of every configuration is a warm-up (connections, allocations) and is not reported; the table
shows the median of the others. peerd's results are checked: all peers bit-identical, error vs the exact weighted
mean.

Bound: 2 (N-1)/N * S_wire / B (B = the slowest peer's rate; S_wire = S after compression), the traffic each peer of
a butterfly or ring all-reduce must upload and download. Link utilization = bound / measured.

Scenarios with slower peers, where parts proportional to bandwidth should win: ``hetero`` (2 of 4 peers at
``--slow-mbit`` both ways) and ``asym`` (all 4 at ``--rate-mbit`` down, 2 of them at ``--slow-up-mbit`` up: the
common home link, whose upload is the bottleneck).

Ceilings (``--impls tcp tcp-ring tcp-prop``): plain sockets moving exactly the bytes of a butterfly (every peer to
every other at once) or of a ring (every peer to its right neighbour), no computation, no waiting between peers: what
TCP itself gets out of the same links, in the same run. ``tcp-prop`` moves a butterfly's bytes with the parts peerd
gives peers of these link rates once they are announced (bandwidth-proportional, :class:`PartPlanner`'s rule): the
slow links' measured TCP bound that the heterogeneous and asymmetric scenarios are held to. ``tcp-paced`` moves
``tcp-prop``'s bytes with each connection paced by the kernel (``SO_MAX_PACING_RATE``) at its share of the sender's
link rate (its bytes over all the sender's bytes): what TCP gets out of the butterfly's pattern when its connections
do not compete. ``tcp-tls`` moves ``tcp``'s bytes over TLS 1.3 (peerd's certificates and contexts,
:class:`peerd.transport.tls.PeerTLS`) through blocking ``ssl`` sockets, one thread per connection (OpenSSL runs
without the GIL): what encryption through Python's ``ssl`` costs at the least, with no event loop and no framing.
``tcp-deps`` moves ``tcp-paced``'s bytes, paced the same way, in the order and with the dependency of a butterfly
all-reduce: every peer sends its slices of the others' parts chunk by chunk (the butterfly's chunks,
:func:`protocols.partition.chunk_bounds` of ``CHUNK_NUMEL`` values), and answers chunk k of its own part only once
every other peer's slice of chunk k arrived; no computation: what TCP allows the butterfly's pattern itself.
No implementation can beat them by much: a 1,514-byte frame carries 1,448 bytes of payload (0.956),
and the ACKs of the download share the upload.

Results replace what the last run wrote into the section ``SECTION`` of docs/benchmarks.md (up to
``benchlib.GENERATED_END``; the notes and dated subsections written by hand after it, and other sections, are kept;
the date is in its text) unless --no-md.
Network hygiene: peers listen only on their namespace's own 10.88.0.x address (or 127.0.0.1 inside a namespace of
ours); hivemind with nat_port_map=False, use_ipfs=False, no relays.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import json
import os
import queue
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchlib import load_wan_testbed, machine_line, replace_section, result_args  # noqa: E402
from peerd.testing.localswarm import ProcessSet, kill_tree  # noqa: E402
from protocols.allreduce import RATE_MIN_RUNS  # noqa: E402
from protocols.allreduce.parts import connection_shares  # noqa: E402
from protocols.partition import CHUNK_NUMEL, chunk_bounds  # noqa: E402

SECTION = "## All-reduce on a virtual WAN: peerd vs hivemind vs gloo (scripts/bench_allreduce.py)"
CODECS = ("none", "fp16", "int8")
#: peerd-direct = peerd with its streams on the direct data plane (TLS 1.3 over TCP, peerd/transport/direct.py), one connection per
#: stream; peerd-mux = the same with one warm multiplexed connection per peer pair (peerd/transport/mux.py), its
#: streams wrapped as the daemon wraps them (``peerd.transport.pacing.pace``: the uplink measured by ``UplinkMeter``
#: from the warm-up on, and each butterfly paced at shares of it);
#: peerd-ring = peerd-mux with ``exchange = "ring"`` (protocols/allreduce/ring.py): its first RATE_MIN_RUNS runs are
#: butterflies that measure the links (warm-ups here), the ring runs once every member announced alike rates;
#: peerd-libp2p = peerd on the py-libp2p transport (peerd/transport/libp2p_backend.py) instead of p2pd.
#: peerd-mux-plain = peerd-mux with the TLS step of the handshake left out (:func:`_plaintext_handshakes`): what
#: encryption costs, measured here only; peerd itself has no plaintext mode.
#: peerd-mux-paced = peerd-mux with each worker's uplink rate declared (the daemon's ``uplink_mb_s``) instead of
#: measured, so that every butterfly paces its connections at their shares of it.
#: tcp, tcp-ring, tcp-prop, tcp-paced, tcp-tls and tcp-deps are ceilings, not all-reduces (see the module
#: docstring and worker_tcp).
IMPLS = ("peerd", "peerd-direct", "peerd-mux", "peerd-mux-plain", "peerd-mux-paced", "peerd-ring", "peerd-libp2p",
         "hivemind", "gloo", "tcp", "tcp-ring", "tcp-prop", "tcp-paced", "tcp-tls", "tcp-deps")
#: The data-plane implementations of peerd (direct TLS streams), with the ceiling of the pattern each uses.
DIRECT = ("peerd-direct", "peerd-mux", "peerd-ring")
#: Implementations on the direct data plane's multiplexed connections.
MULTIPLEXED = ("peerd-mux", "peerd-mux-plain", "peerd-mux-paced", "peerd-ring")
PEERD = ("peerd", *DIRECT, "peerd-mux-plain", "peerd-mux-paced", "peerd-libp2p")
#: Workers told every peer's link rate (``--rates-mbit``): the ceilings, and peerd paced by it.
KNOW_RATES = ("tcp", "tcp-ring", "tcp-prop", "tcp-paced", "tcp-deps", "peerd-mux-paced")
#: Codecs each implementation can run (gloo sums in the tensor's dtype: no int8; the ring re-encodes float values).
IMPL_CODECS = {"gloo": ("none", "fp16"), "tcp": ("none", "fp16"), "tcp-ring": ("none", "fp16"),
               "tcp-prop": ("none", "fp16"), "tcp-paced": ("none", "fp16"), "tcp-tls": ("none", "fp16"),
               "tcp-deps": ("none", "fp16"), "peerd-ring": ("none", "fp16")}
#: The unpaced plain-TCP ceilings of the two patterns (equal parts): what the ">= 0.97 of the pattern's ceiling"
#: target compares with; the other ceilings are printed beside it.
PATTERN_CEILINGS = ("tcp", "tcp-ring")
CEILINGS = (*PATTERN_CEILINGS, "tcp-prop", "tcp-paced", "tcp-tls", "tcp-deps")
#: Workers without a DHT: no bootstrap peer, no matchmaking, fp32 and fp16 only.
STANDALONE = ("gloo", *CEILINGS)
WIRE_BYTES_PER_VALUE = {"none": 4.0, "fp16": 2.0, "int8": 1.0 + 4.0 / 256}


# ======================================================================================================= worker side


def proportional_parts(numel: int, rates_mbit: list[float]) -> list[int]:
    """The parts (values) that peerd gives peers of these link rates (Mbit/s, the slower direction; 0 = unshaped)
    once they are announced: :meth:`protocols.allreduce.PartPlanner.part_sizes`' rule for a group that announced
    exactly its links' rates."""
    from protocols.allreduce import MIN_SHARE, RATE_SPREAD, partition_sizes
    from protocols.partition import proportional_sizes

    if not rates_mbit or min(rates_mbit) <= 0 or max(rates_mbit) <= RATE_SPREAD * min(rates_mbit):
        return partition_sizes(numel, len(rates_mbit))
    return proportional_sizes(numel, rates_mbit, MIN_SHARE)


def make_tensor(rank: int, rep: int, numel: int):
    import torch

    g = torch.Generator().manual_seed(1000 * rep + rank)
    return torch.randn(numel, generator=g)  # (P,) fp32


def reference_mean(world: int, rep: int, numel: int):
    import torch

    total = torch.zeros(numel, dtype=torch.float64)
    for r in range(world):
        total += (r + 1) * make_tensor(r, rep, numel).double()
    return total / sum(r + 1 for r in range(world))


def check_result(averaged, reference) -> tuple[float, str]:
    """(max |averaged - reference|, a digest of the averaged bytes) for one peer's result (P,) fp32.

    The reference is computed before the repetition, and this check runs off a peerd worker's event loop: a peer
    done early still has answers for the slower members in its transport's buffers, which only its event loop moves
    to the kernel. Computed on the loop after the run (the world's tensors regenerated: ~1 CPU s for 8 peers of
    25 MB), the check held those answers back ~3 s on the 2-core machine whenever a peer finished ahead of another's
    last part: the 8-peer butterfly's outlier repetitions of earlier runs (7.4-8.6 s against 4.4-4.9)."""
    err = float((averaged.double() - reference).abs().max())
    return err, hashlib.sha256(averaged.numpy().tobytes()).hexdigest()[:16]


_CPU_PROCS: list = []


def cpu_tree() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process ("main"), its p2pd daemons ("p2pd") and its other
    descendants ("helpers": hivemind's DHT and averager processes). The process list is read once (after start-up)
    so that a sample costs well under a millisecond."""
    import psutil

    if not _CPU_PROCS:
        me = psutil.Process()
        _CPU_PROCS.append(("main", me))
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                daemon = "p2pd" in child.name() or "libp2p_daemon" in " ".join(child.cmdline())
                _CPU_PROCS.append(("p2pd" if daemon else "helpers", child))
    out = {"main": 0.0, "p2pd": 0.0, "helpers": 0.0}
    for kind, proc in _CPU_PROCS:
        with contextlib.suppress(psutil.NoSuchProcess):
            out[kind] += sum(proc.cpu_times()[:2])
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 4) for k in after}


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {e}"[:300]


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _stdin_lines():
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        yield line.split()


def _my_maddr(maddrs: list[str], host: str) -> str:
    mine = [m for m in maddrs if f"/ip4/{host}/" in m]
    if not mine:
        raise RuntimeError(f"no multiaddr on {host} among {maddrs}")
    return mine[0]


def _plaintext_handshakes() -> None:
    """Make this worker's direct data plane run its handshake without the TLS step (``peerd-mux-plain``): the same
    hello, name and answer frames, the client's PeerID taken from its hello's certificate, no proof of its key and
    no encryption after. For measuring what encryption costs on the same path; peerd has no such mode (a peer
    refuses a hello that does not go on to TLS), so both ends of every connection must be patched workers."""
    from peerd.transport import direct
    from peerd.transport.handshake import VERSION, HandshakeRefused
    from peerd.transport.tls import peer_id_of_certificate
    from protocols.wire import read_frame, require, write_frame

    async def client(conn, tls, server_peer_id: str, name: str) -> None:
        for frame in ({"v": VERSION, "to": server_peer_id, "cert": tls.certificate}, {"name": name}):
            await write_frame(conn, frame)
            reply, _, _ = await read_frame(conn, max_payload_bytes=0)
            if "error" in reply:
                raise HandshakeRefused(str(reply["error"]), str(reply.get("code")))

    async def server(conn, tls, served):
        hello, _, _ = await read_frame(conn, max_payload_bytes=0)
        client_id = peer_id_of_certificate(require(hello, "cert", bytes))
        await write_frame(conn, {"v": VERSION})
        request, _, _ = await read_frame(conn, max_payload_bytes=0)
        name = require(request, "name", str)
        if not served(name):
            await write_frame(conn, {"error": f"{name!r} is not served", "code": "not_served"})
            raise HandshakeRefused(f"{name!r} is not served", "not_served")
        await write_frame(conn, {})
        return client_id, name

    direct.client_handshake, direct.server_handshake = client, server


async def worker_peerd(a: argparse.Namespace) -> None:
    """peerd's averaging; with ``--worker peerd-direct`` its streams go over the direct TCP data plane
    (:class:`peerd.transport.direct.DirectStreams`, bound to the same host as p2pd), p2pd only as fallback."""
    import types

    import torch

    from peerd.runtime.heap import freeze_heap
    from peerd.transport.hivemind_backend import HivemindTransport
    from protocols.allreduce import AllReduceConfig, AllReduceFailed, ButterflyAllReduce, RingAllReduce
    from protocols.matchmaking import Matchmaker, MatchmakingConfig, MatchmakingFailed

    torch.set_num_threads(1)
    identity_path = direct = None
    if a.impl == "peerd-mux-plain":
        _plaintext_handshakes()
    if a.impl in (*DIRECT, *MULTIPLEXED):
        from peerd.identity.key import load_or_create_identity

        identity_path = os.path.join(tempfile.mkdtemp(prefix="bench_identity_"), "peer.key")
        load_or_create_identity(identity_path)
    transport_class = HivemindTransport
    if a.impl == "peerd-libp2p":
        from peerd.transport.libp2p_backend import LibP2PTransport as transport_class
    network = await transport_class.create(initial_peers=a.initial_peers, host_maddrs=[f"/ip4/{a.host}/tcp/0"],
                                           identity_path=identity_path, nat_port_map=False)
    transport = network
    if identity_path is not None:
        from peerd.identity.signing import Signer
        from peerd.transport.direct import DirectStreams

        direct = DirectStreams(network.streams, network.discovery, Signer.from_identity_file(identity_path), a.host,
                               multiplex=a.impl in MULTIPLEXED)
        await direct.start()
        streams = direct
        if a.impl in ("peerd-mux", "peerd-mux-plain", "peerd-mux-paced"):  # as the daemon wraps them: the uplink
            from peerd.transport.pacing import pace  # measured (UplinkMeter), or declared (`uplink_mb_s`)

            declared = a.rates_mbit[a.rank] * 1e6 / 8 if a.impl == "peerd-mux-paced" else 0.0
            streams = pace(direct, uplink_bytes_per_s=declared)
        transport = types.SimpleNamespace(discovery=network.discovery, streams=streams)
    profiler = None
    if a.profile_to:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # the event loop thread's CPU time: the peers share the cores
    try:
        runners = {}
        for codec in a.codecs:
            prefix = f"bench.{codec}"
            mm = Matchmaker(transport, prefix, MatchmakingConfig(matchmaking_timeout_s=60, request_timeout_s=5,
                                                                 poll_interval_s=0.5, min_group_size=a.world))
            ring = a.impl == "peerd-ring"
            ar = (RingAllReduce if ring else ButterflyAllReduce)(
                transport, prefix, AllReduceConfig(codec, sender_timeout_s=120, reducer_timeout_s=240,
                                                   exchange="ring" if ring else "reduce"))
            await mm.start()
            await ar.start()
            runners[codec] = (mm, ar)
        cpu_tree()
        freeze_heap()  # as a training peer does once set up (PEERD_FREEZE_HEAP=0: not)
        emit({"ready": _my_maddr(network.visible_maddrs(), a.host)})
        async for cmd in _stdin_lines():
            if cmd[0] == "quit":
                break
            codec, rep = cmd[1], int(cmd[2])
            mm, ar = runners[codec]
            x = make_tensor(a.rank, rep, a.numel)
            reference = reference_mean(a.world, rep, a.numel)  # before the repetition: see check_result
            t_go = time.time()
            try:
                # the rates measured in earlier repetitions (the warm-up's included) size the parts
                group = await mm.form_group(f"{codec}-rep{rep}", ar.announce(), expected_size=a.world)
                cpu0 = cpu_tree()
                t_start = time.time()
                rings = getattr(ar, "rings_run", 0)
                if profiler is not None and rep >= a.profile_from:
                    profiler.enable()
                try:
                    result = await ar.run(group, x, float(a.rank + 1))
                finally:
                    if profiler is not None:
                        profiler.disable()
                t_end = time.time()
                cpu1 = cpu_tree()
            except (AllReduceFailed, MatchmakingFailed) as e:  # a failed round: report it, go on with the next
                emit({"failed": f"{type(e).__name__}: {_root_cause(e)}"})
                continue
            # off the event loop: our answers to slower members may still be leaving through it
            err, digest = await asyncio.get_running_loop().run_in_executor(None, check_result, result.averaged,
                                                                           reference)
            emit({"go": t_go, "start": t_start, "end": t_end, "group_size": result.group_size,
                  "sent": result.bytes_sent, "received": result.bytes_received, "max_err": err,
                  "digest": digest, "cpu": cpu_delta(cpu0, cpu1),
                  "pattern": "ring" if getattr(ar, "rings_run", 0) > rings else "butterfly"})
            if direct is not None:  # which path the streams took, in the worker's log
                uplink = getattr(streams, "uplink", None)
                meter = uplink.meter if uplink is not None else None
                measured = (f"; uplink peaks measured (MB/s) {[round(p / 1e6, 2) for p in meter.peaks]}, path-bound "
                            f"{meter.path_limited:.2f} of a window at most" if meter is not None else "")
                print(f"direct data plane, rep {rep}: {dict(direct.stats)}; announced {ar.announce()}{measured}",
                      file=sys.stderr, flush=True)
    finally:
        if profiler is not None:  # every measured run of this worker, all codecs together
            profiler.dump_stats(f"{a.profile_to}-rank{a.rank}.prof")
        if direct is not None:
            await direct.stop()
        await network.shutdown()


def worker_hivemind(a: argparse.Namespace) -> None:
    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    torch.set_num_threads(1)
    codecs = {"none": NoCompression(), "fp16": Float16Compression(), "int8": Uniform8BitQuantization()}
    dht = hivemind.DHT(initial_peers=a.initial_peers, host_maddrs=[f"/ip4/{a.host}/tcp/0"], start=True,
                       nat_port_map=False, use_ipfs=False, use_relay=False, use_auto_relay=False)
    averagers = {}
    try:
        for codec in a.codecs:
            averagers[codec] = hivemind.DecentralizedAverager(
                [torch.zeros(a.numel)], dht, prefix=f"bench_{codec}", start=True, target_group_size=a.world,
                min_group_size=a.world, compression=codecs[codec], min_matchmaking_time=2.0, request_timeout=1.0,
                allreduce_timeout=150, sender_timeout=60, reducer_timeout=120, next_chunk_timeout=30)
        cpu_tree()
        emit({"ready": _my_maddr([str(m) for m in dht.get_visible_maddrs()], a.host)})
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            codec, rep = cmd[1], int(cmd[2])
            averager = averagers[codec]
            x = make_tensor(a.rank, rep, a.numel)
            reference = reference_mean(a.world, rep, a.numel)  # before the repetition: see check_result
            with averager.get_tensors() as tensors:
                tensors[0].copy_(x)
            t_go = time.time()
            control = averager.step(weight=float(a.rank + 1), wait=False, require_trigger=True, timeout=120)
            while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
                time.sleep(0.001)
            cpu0 = cpu_tree()
            t_start = time.time()
            control.allow_allreduce()
            try:
                gathered = control.result()
            except Exception as e:  # noqa: BLE001 - a failed round: report it, go on with the next
                emit({"failed": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            t_end = time.time()
            cpu1 = cpu_tree()
            if not gathered:
                emit({"failed": "step returned no group"})
                continue
            with averager.get_tensors() as tensors:
                out = tensors[0].clone()
            err, digest = check_result(out, reference)
            emit({"go": t_go, "start": t_start, "end": t_end, "group_size": len(gathered) if gathered else 0,
                  "max_err": err, "digest": digest,
                  "cpu": cpu_delta(cpu0, cpu1)})
    finally:
        for averager in averagers.values():
            averager.shutdown()
        dht.shutdown()


def worker_gloo(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = a.ifname
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        dist.all_reduce(torch.ones(16))  # connect everyone
        cpu_tree()
        emit({"ready": a.host})
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            codec, rep = cmd[1], int(cmd[2])
            x = make_tensor(a.rank, rep, a.numel) * (a.rank + 1)
            x = x.half() if codec == "fp16" else x
            t_go = time.time()
            dist.barrier()
            cpu0 = cpu_tree()
            t_start = time.time()
            dist.all_reduce(x)
            t_end = time.time()
            cpu1 = cpu_tree()
            emit({"go": t_go, "start": t_start, "end": t_end, "group_size": a.world, "cpu": cpu_delta(cpu0, cpu1)})
    finally:
        dist.destroy_process_group()


def worker_tcp(a: argparse.Namespace) -> None:
    """The ceilings (:data:`CEILINGS`): listen on ``--port`` + rank, dial every other
    peer once (warm connections, one per direction; tcp-tls: each then upgraded to TLS 1.3, the dialer's certificate
    pinned as the data plane's hello does), then per repetition: a barrier (one byte to and from every peer), then
    send and receive the pattern's bytes, every connection in its own thread (tcp-deps: two per connection, in the
    butterfly's order, :func:`_butterfly_threads`)."""
    import socket

    from peerd.transport.connection import TCP_CONGESTION_NAME, set_congestion

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((a.host, a.port + a.rank))
    listener.listen(a.world)
    emit({"ready": a.host})
    peers = [r for r in range(a.world) if r != a.rank]
    out: dict[int, socket.socket] = {}
    for r in peers:
        host = a.peer_hosts[r]
        deadline = time.time() + 60
        while True:
            try:
                out[r] = socket.create_connection((host, a.port + r), timeout=60)
                set_congestion(out[r], TCP_CONGESTION_NAME)
                out[r].sendall(bytes([a.rank]))
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
    inc: dict[int, socket.socket] = {}
    while len(inc) < len(peers):
        conn, _ = listener.accept()
        conn.settimeout(None)
        inc[conn.recv(1)[0]] = conn
    for sock in out.values():
        sock.settimeout(None)
    if a.impl == "tcp-tls":
        out, inc = _upgrade_to_tls(out, inc)
    right = (a.rank + 1) % a.world
    view = memoryview(bytearray(int(2 * WIRE_BYTES_PER_VALUE["none"] * a.numel)))  # the largest send: 2 S
    scratch = memoryview(bytearray(1 << 20))  # what every receiving thread reads into: the bytes are not kept

    def recv_exactly(sock: socket.socket, n: int) -> None:
        while n:
            got = sock.recv_into(scratch, min(n, len(scratch)))
            if not got:
                raise ConnectionError("peer closed")
            n -= got

    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        codec = cmd[1]
        wire = WIRE_BYTES_PER_VALUE[codec] * a.numel
        if a.impl in ("tcp", "tcp-tls"):
            sends = {r: int(2 * wire / a.world) for r in peers}
            recvs = dict(sends)
        elif a.impl in ("tcp-prop", "tcp-paced", "tcp-deps"):
            # to r: our slice of r's part and our part's answer; the same back
            sizes = proportional_parts(a.numel, a.rates_mbit)
            sends = {r: int((sizes[r] + sizes[a.rank]) * WIRE_BYTES_PER_VALUE[codec]) for r in peers}
            recvs = dict(sends)
            if a.impl in ("tcp-paced", "tcp-deps") and a.rates_mbit[a.rank] > 0:
                from peerd.transport.connection import set_pacing

                shares = connection_shares(sizes, a.rank)
                for r in peers:
                    set_pacing(out[r], shares[r] * a.rates_mbit[a.rank] * 1e6 / 8)
        else:
            sends = {right: int(2 * (a.world - 1) / a.world * wire)}
            recvs = {(a.rank - 1) % a.world: sends[right]}
        t_go = time.time()
        for sock in out.values():
            sock.sendall(b"g")
        for sock in inc.values():
            recv_exactly(sock, 1)
        cpu0 = cpu_tree()
        t_start = time.time()
        if a.impl == "tcp-deps":
            threads = _butterfly_threads(out, inc, sizes, a.rank, WIRE_BYTES_PER_VALUE[codec], view, recv_exactly)
        else:
            threads = [threading.Thread(target=out[r].sendall, args=(view[:n],)) for r, n in sends.items()]
            threads += [threading.Thread(target=recv_exactly, args=(inc[r], n)) for r, n in recvs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_end = time.time()
        cpu1 = cpu_tree()
        emit({"go": t_go, "start": t_start, "end": t_end, "group_size": a.world, "cpu": cpu_delta(cpu0, cpu1)})
    for sock in [*out.values(), *inc.values(), listener]:
        sock.close()


def _butterfly_threads(out: dict, inc: dict, sizes: list[int], me: int, bytes_per_value: float, view: memoryview,
                       recv_exactly) -> list[threading.Thread]:
    """tcp-deps: per peer r, a thread that sends our slices of r's part (``sizes[r]`` values) chunk by chunk on
    ``out[r]``, then our answers of our part, chunk k once every peer's slice of chunk k arrived; and a thread that
    receives r's slices of our part on ``inc[r]`` (counting each chunk's arrivals), then r's answers of its part.
    Chunks are the butterfly's (:func:`protocols.partition.chunk_bounds` of :data:`CHUNK_NUMEL` values)."""

    def chunk_bytes(part: int) -> list[int]:
        return [int((b - a) * bytes_per_value) for a, b in chunk_bounds(sizes[part], CHUNK_NUMEL)]

    ours = chunk_bytes(me)
    arrived = [0] * len(ours)
    changed = threading.Condition()

    def send(r: int) -> None:
        for n in chunk_bytes(r):
            out[r].sendall(view[:n])
        for k, n in enumerate(ours):
            with changed:
                changed.wait_for(lambda: arrived[k] == len(inc))
            out[r].sendall(view[:n])

    def receive(r: int) -> None:
        for k, n in enumerate(ours):
            recv_exactly(inc[r], n)
            with changed:
                arrived[k] += 1
                changed.notify_all()
        for n in chunk_bytes(r):
            recv_exactly(inc[r], n)

    return [threading.Thread(target=f, args=(r,)) for r in out for f in (send, receive)]


def _upgrade_to_tls(out: dict, inc: dict) -> tuple[dict, dict]:
    """TLS 1.3 on every warm connection of :func:`worker_tcp`, all handshakes at once (each peer dials and accepts):
    the dialer sends its certificate (4-byte length, DER) and the acceptor pins it, as
    :mod:`peerd.transport.handshake`'s hello does; the dialer does not check the acceptor's PeerID (the handshake is
    not what the ceiling measures)."""
    import socket
    import struct

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from peerd.identity.signing import Signer
    from peerd.transport.tls import PeerTLS

    tls = PeerTLS(Signer(Ed25519PrivateKey.generate()))
    tls_out: dict[int, socket.socket] = {}
    tls_in: dict[int, socket.socket] = {}

    def dial(r: int) -> None:
        out[r].sendall(struct.pack(">I", len(tls.certificate)) + tls.certificate)
        tls_out[r] = tls.client_context.wrap_socket(out[r])

    def accept(r: int) -> None:
        (n,) = struct.unpack(">I", inc[r].recv(4, socket.MSG_WAITALL))
        tls_in[r] = tls.server_context(inc[r].recv(n, socket.MSG_WAITALL)).wrap_socket(inc[r], server_side=True)

    threads = [threading.Thread(target=dial, args=(r,)) for r in out]
    threads += [threading.Thread(target=accept, args=(r,)) for r in inc]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tls.close()
    failed = len(out) - len(tls_out) + len(inc) - len(tls_in)
    if failed:
        raise ConnectionError(f"{failed} TLS handshake(s) failed")
    return tls_out, tls_in


def worker_main(a: argparse.Namespace) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.impl in PEERD:
        import uvloop

        uvloop.run(worker_peerd(a))
    elif a.impl == "hivemind":
        worker_hivemind(a)
    elif a.impl in CEILINGS:
        worker_tcp(a)
    else:
        worker_gloo(a)


# ======================================================================================================= driver side


@dataclass
class Scenario:
    key: str
    title: str
    world: int
    rates_mbit: list[Optional[float]]
    """Per-peer rate (both directions); None = unshaped. Empty for loopback."""
    codecs: tuple[str, ...]
    up_mbit: list[Optional[float]] = field(default_factory=list)
    """Per-peer upload rate where it differs from ``rates_mbit`` (an asymmetric home link); empty: none does."""

    def link_mbit(self, peer: int) -> tuple[Optional[float], Optional[float]]:
        """(up, down) of ``peer`` in Mbit/s."""
        down = self.rates_mbit[peer]
        return (self.up_mbit[peer] if self.up_mbit else down), down

    @property
    def loopback(self) -> bool:
        return not self.rates_mbit

    @property
    def slowest_bps(self) -> Optional[float]:
        rates = [r for r in [*self.rates_mbit, *self.up_mbit] if r]
        return min(rates) * 1e6 if rates else None


@dataclass
class Row:
    scenario: str
    impl: str
    codec: str
    world: int
    times: list[float] = field(default_factory=list)
    matchmaking: list[float] = field(default_factory=list)
    max_err: Optional[float] = None
    identical: Optional[bool] = None
    error: Optional[str] = None
    """Why the configuration stopped early (a worker crashed or hung), if it did."""
    failures: list[str] = field(default_factory=list)
    """Repetitions (warm-up included) that failed on some peer, with the first peer's reason."""
    cpu: list[dict[str, float]] = field(default_factory=list)
    """Per repetition: CPU seconds of all peers during their all-reduce windows, by process kind."""
    patterns: list[str] = field(default_factory=list)
    """Per repetition (peerd): the pattern the peers ran, ``ring``, ``butterfly`` or both (``butterfly/ring``)."""

    def cpu_median(self) -> dict[str, float]:
        kinds = sorted({k for c in self.cpu for k in c})
        return {k: statistics.median(c.get(k, 0.0) for c in self.cpu) for k in kinds}


class Worker:
    """One worker process; lines on stdout are JSON, read by a thread into a queue."""

    def __init__(self, argv: list[str], log_path: str):
        self.log = open(log_path, "w")
        self.proc = ProcessSet().start(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                       text=True)
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.log_path = log_path
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float) -> dict:
        deadline = time.time() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                raise TimeoutError(f"worker silent for {timeout_s} s; log {self.log_path}:\n{self.tail()}") from None
            if line is None:
                raise RuntimeError(f"worker exited ({self.proc.poll()}); log {self.log_path}:\n{self.tail()}")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)

    def tail(self, chars: int = 2000) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def kill(self) -> None:
        kill_tree(self.proc.pid)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


def run_impl(tb, sc: Scenario, impl: str, args, workdir: str) -> list[Row]:
    """Run every codec's repetitions with ``sc.world`` workers of ``impl`` in the testbed.

    A repetition that fails on some peer (e.g. AllReduceFailed) is counted in ``Row.failures`` and left out of the
    times; a worker that crashes or hangs fails the rest of that codec, and fresh workers start for the next codec.
    """
    codecs = [c for c in sc.codecs if c in IMPL_CODECS.get(impl, CODECS)]
    # the ring runs once every member measured its links: its butterfly runs before that are warm-ups too
    warmups = RATE_MIN_RUNS if impl == "peerd-ring" else 1
    rows = {c: Row(sc.key, impl, c, sc.world) for c in codecs}
    workers: list[Worker] = []
    generation = 0

    def start_workers() -> list[Worker]:
        nonlocal generation
        generation += 1
        started: list[Worker] = []
        base = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--world", str(sc.world),
                "--numel", str(args.numel), "--codecs", *codecs]
        if args.profile and impl in PEERD:
            os.makedirs(args.profile, exist_ok=True)
            base += ["--profile-to", os.path.join(os.path.abspath(args.profile), f"{sc.key}-{impl}"),
                     "--profile-from", str(warmups)]
        port = 29500 + (os.getpid() + generation) % 1000
        first_maddr = None
        try:
            for rank in range(sc.world):
                host = "127.0.0.1" if sc.loopback else tb.addr(rank)
                argv = base + ["--rank", str(rank), "--host", host]
                if impl == "gloo":
                    master = "127.0.0.1" if sc.loopback else tb.addr(0)
                    argv += ["--master", master, "--port", str(port), "--ifname", "lo" if sc.loopback else "eth0"]
                elif impl in CEILINGS:
                    argv += ["--port", str(port + 1000),
                             "--peer-hosts", *(["127.0.0.1"] * sc.world if sc.loopback else
                                               [tb.addr(r) for r in range(sc.world)])]
                elif rank > 0:
                    argv += ["--initial-peers", first_maddr]
                if impl in KNOW_RATES:
                    argv += ["--rates-mbit", *(str(min((x for x in sc.link_mbit(r) if x), default=0.0))
                                               if not sc.loopback else "0" for r in range(sc.world))]
                log = os.path.join(workdir, f"{sc.key}-{impl}-g{generation}-{rank}.log")
                started.append(Worker(tb.wrap(0 if sc.loopback else rank, argv), log))
                if impl not in STANDALONE and rank == 0:
                    first_maddr = started[0].read(120)["ready"]
            for w in started[1:] if impl not in STANDALONE else started:
                w.read(180)
        except BaseException:
            stop_workers(started)
            raise
        return started

    for codec in codecs:
        row = rows[codec]
        try:
            if not workers:
                workers = start_workers()
            for rep in range(args.reps + warmups):
                for w in workers:
                    w.send(f"go {codec} {rep}")
                results = [w.read(args.rep_timeout_s) for w in workers]
                failed = [r["failed"] for r in results if "failed" in r]
                if failed:
                    row.failures.append(("warm-up: " if rep < warmups else "") + failed[0])
                    print(f"  {sc.key} {impl} {codec} rep {rep}: FAILED on {len(failed)} peer(s): {failed[0]}",
                          flush=True)
                    continue
                if rep < warmups:
                    continue
                record(row, results, sc.world)
                spread = {k: max(r[k] for r in results) - min(r[k] for r in results) for k in ("start", "end")}
                print(f"  {sc.key} {impl} {codec} rep {rep}: {row.times[-1]:.3f} s "
                      f"(matchmaking {row.matchmaking[-1]:.2f} s; the members started within "
                      f"{spread['start']:.3f} s and ended within {spread['end']:.3f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - a crashed or silent worker: report, restart for the next codec
            row.error = summarize(e)
            print(f"  {sc.key} {impl} {codec} ABORTED: {row.error}", flush=True)
            stop_workers(workers)
            workers = []
    stop_workers(workers)
    return list(rows.values())


def record(row: Row, results: list[dict], world: int) -> None:
    sizes = {r["group_size"] for r in results}
    if sizes != {world}:
        raise RuntimeError(f"group sizes {sizes}, expected {world}")
    row.times.append(max(r["end"] for r in results) - min(r["start"] for r in results))
    row.matchmaking.append(statistics.median(r["start"] - r["go"] for r in results))
    row.cpu.append({k: sum(r["cpu"].get(k, 0.0) for r in results) for k in results[0]["cpu"]})
    patterns = {r.get("pattern") for r in results} - {None}
    if patterns:
        row.patterns.append("/".join(sorted(patterns)))
    if "digest" in results[0]:
        same = len({r["digest"] for r in results}) == 1
        row.identical = same if row.identical is None else (row.identical and same)
        err = max(r["max_err"] for r in results)
        row.max_err = err if row.max_err is None else max(row.max_err, err)


def summarize(e: BaseException) -> str:
    """One line: the last 'SomeError: message' line of a worker's log tail, else the exception itself."""
    text = str(e)
    lines = [l.strip() for l in text.splitlines()
             if re.match(r"^[\w.]+(Error|Exception|Violation|Failed|Timeout\w*)\b.*:", l.strip())]
    first = text.splitlines()[0] if text else type(e).__name__
    return (first.split(";")[0] + (f": {lines[-1]}" if lines else ""))[:300]


def stop_workers(workers: list[Worker]) -> None:
    for w in workers:
        try:
            w.send("quit")
        except (BrokenPipeError, OSError, ValueError):
            pass
    if workers:
        time.sleep(0.5)
    for w in workers:
        w.kill()


def bound_s(sc: Scenario, codec: str, numel: int) -> Optional[float]:
    if sc.slowest_bps is None:
        return None
    wire = WIRE_BYTES_PER_VALUE[codec] * numel
    return 2 * (sc.world - 1) / sc.world * wire * 8 / sc.slowest_bps


def fmt(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(rows: list[Row], scenarios: dict[str, Scenario], args, meta: dict) -> str:
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    by = {(r.scenario, r.impl, r.codec, r.world): r for r in rows}
    out = [SECTION,
           "",
           f"Command: `{meta['command']}`  ",
           f"Date: {meta['date']}  ",
           f"Machine: {meta['machine']}  ",
           f"Whole benchmark: {meta['wall_s']:.0f} s wall.",
           "",
           f"Setup: each peer averages {args.numel * 4 / 1e6:g} MB of fp32 (weight rank + 1), one process per peer "
           "(plus its DHT child and p2pd for peerd/hivemind) inside its own network namespace of "
           "`scripts/wan_testbed` (tbf per peer, both directions, no added delay); loopback = all peers in one "
           "namespace on 127.0.0.1, unshaped. peerd = `Matchmaker` + `ButterflyAllReduce` on `HivemindTransport` "
           "(uvloop); peerd-direct = the same with its streams on the direct data plane (TLS 1.3 over TCP, `DirectStreams`, "
           "p2pd only as fallback), one TCP connection per stream; peerd-mux = the same with one warm multiplexed "
           "connection per peer pair (`DirectStreams(multiplex=True)`), each butterfly paced at its connections' "
           "shares of the uplink measured during the earlier runs (the daemon's default: `UplinkMeter`, from the "
           "bytes delivered; the warm-up runs unpaced); peerd-ring = peerd-mux with `exchange = "
           "\"ring\"` (`RingAllReduce`: its first runs are butterflies that measure the links, untimed warm-ups "
           f"here, {RATE_MIN_RUNS} in all; it rings once every member announced alike rates); peerd-libp2p = peerd on "
           "the py-libp2p "
           "transport (its Python libp2p daemon process counts as p2pd below); hivemind = `DecentralizedAverager` "
           "(defaults, part_size 512 KB, "
           "min_matchmaking_time 2 s); "
           "gloo = "
           "`torch.distributed.all_reduce` (fp16 = a half tensor; gloo has no int8 all-reduce); tcp and tcp-ring "
           "= ceilings, not all-reduces: plain sockets (one warm connection per direction and pair) moving exactly "
           "a butterfly's bytes (every peer sends 2 S_wire / N to every other, all at once) or a ring's (every "
           "peer sends 2 (N-1)/N S_wire to its right neighbour), no computation. Time = median of "
           f"{args.reps} repetitions after one warm-up of `max(end) - min(start)` over peers, start = the peer has its "
           "group (peerd, hivemind) or left a barrier (gloo); matchmaking (median over peers, from the common 'go' to "
           "having the group) is excluded and shown apart. Bound = 2(N-1)/N x wire bytes / slowest rate; link "
           "utilization = bound / time. CPU s = CPU seconds of all peers together inside their all-reduce windows "
           "(median over repetitions): the peer's own process (main), its p2pd daemon, and its other processes "
           "(helpers: hivemind's DHT and averager processes). All peers share the machine's 2 cores, so a 2-core "
           "second holds at most 2 CPU seconds. CPU ms per MB = those CPU seconds per MB of fp32 vector averaged "
           "(N peers x S), whatever the codec. peerd-mux-plain = peerd-mux with the TLS step of its handshake "
           "left out in the benchmark's workers (no encryption; peerd has no such mode): what encryption costs. "
           "peerd-mux-paced = peerd-mux with each peer's uplink rate declared (the node setting `uplink_mb_s`, "
           "here the link's shaped rate): every butterfly paces its connections at their shares of it "
           "(`SO_MAX_PACING_RATE`); tcp-paced = tcp-prop's bytes with each connection paced the same way; tcp-tls = "
           "tcp's bytes over TLS 1.3 (peerd's certificates) through blocking `ssl` sockets, a thread per connection: "
           "what encryption through Python's `ssl` costs at the least; tcp-deps = tcp-paced's bytes, paced the same "
           "way, in a butterfly's order with its dependency (a peer answers chunk k of its part once every other "
           "peer's slice of chunk k arrived)."
           + (f" TCP congestion control of the peers' data sockets: {args.congestion} (`--congestion`)."
              if args.congestion else ""),
           ""]
    for sc in scenarios.values():
        out.append(f"### {sc.title}")
        out.append("")
        shaped = not sc.loopback
        head = "| codec | impl | all-reduce s |" + (" bound s | link util |" if shaped else " vs gloo (same codec) |")
        head += (" matchmaking s | CPU s: main + p2pd + helpers | CPU ms per MB | all peers bit-identical, max err |"
                 " reps (s) | failed reps |")
        out.append(head)
        out.append("|" + "---|" * (head.count("|") - 1))
        notes: list[str] = []
        for codec in sc.codecs:
            for impl in IMPLS:
                r = by.get((sc.key, impl, codec, sc.world))
                if r is None:
                    continue
                t = med(r.times)
                cells = [codec, impl, fmt(t) if r.times else "**failed**"]
                if shaped:
                    b = bound_s(sc, codec, args.numel)
                    cells += [fmt(b), fmt(b / t) if (b and t) else "-"]
                else:
                    g = by.get((sc.key, "gloo", codec, sc.world))
                    gt = med(g.times) if g else None
                    cells += [f"{t / gt:.1f}x" if (t and gt) else "-"]
                cells += [fmt(med(r.matchmaking)) if impl not in STANDALONE else "-"]
                c = r.cpu_median()
                parts = " + ".join(f"{c.get(k, 0.0):.2f}" for k in ("main", "p2pd", "helpers"))
                cells += [f"{sum(c.values()):.2f} = {parts}" if c else "-"]
                cells += [f"{sum(c.values()) * 1e3 / (sc.world * args.numel * 4 / 1e6):.1f}" if c else "-"]
                cells += [f"{'yes' if r.identical else 'NO'}, {r.max_err:.1e}" if r.identical is not None
                          else (f"-, {r.max_err:.1e}" if r.max_err is not None else "-")]
                cells += [" ".join(f"{x:.2f}" for x in r.times) or "-"]
                problems = r.failures + ([f"stopped: {r.error}"] if r.error else [])
                if impl == "peerd-ring" and any(p != "ring" for p in r.patterns):
                    problems.append(f"patterns run: {' '.join(r.patterns)}")
                if problems:
                    notes.append(f"[{len(notes) + 1}] {codec} {impl}: " + "; ".join(dict.fromkeys(problems)))
                cells += [f"{len(r.failures)}{' + aborted' if r.error else ''} [{len(notes)}]" if problems else "0"]
                out.append("| " + " | ".join(cells) + " |")
        out.append("")
        if notes:
            out += [n.replace("|", "/") + "  " for n in notes] + [""]
        if sc.key.startswith("asy"):
            out.append(f"Bound here = equal parts: the peers with a {sc.slowest_bps / 1e6:g} Mbit/s upload send "
                       f"2(N-1)/N of the vector (their slices and their part's answers). With parts proportional to "
                       f"each peer's slower direction (those peers reduce nothing and upload their vector once) the "
                       f"bound is S / B_up = {fmt(args.numel * 4 * 8 / sc.slowest_bps)} s for fp32.")
            out.append("")
        if sc.key.startswith("het"):
            fast = max(r for r in sc.rates_mbit if r)
            out.append(f"Bound here = equal parts (what peerd, hivemind without `bandwidth` and gloo's ring do): the "
                       f"{sc.slowest_bps / 1e6:g} Mbit/s peers carry 2(N-1)/N of the vector each way. With parts "
                       f"proportional to bandwidth (slow peers reduce nothing, send their vector once and receive the "
                       f"result once) the bound is S / B_slow = {fmt(args.numel * 4 * 8 / sc.slowest_bps)} s "
                       f"for fp32 (fast peers then move 2 S each at {fast:g} Mbit/s, which fits).")
            out.append("")
    out += verdicts(rows, scenarios, args)
    return "\n".join(out) + "\n"


def verdicts(rows: list[Row], scenarios: dict[str, Scenario], args) -> list[str]:
    """The data plane's targets (encrypted): link utilization >= 0.97 of the same run's TCP ceiling for the pattern
    used (tcp-ring for the ring, tcp for the butterfly) and >= 0.90 absolute at the shaped rate, <= 2.0x gloo on
    loopback, within 10% of the slow links' measured TCP bound with slow peers."""
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    by = {(r.scenario, r.impl, r.codec, r.world): r for r in rows}

    def time_of(sc: Scenario, impl: str, codec: str) -> Optional[float]:
        r = by.get((sc.key, impl, codec, sc.world))
        return med(r.times) if r and r.times else None

    lines = ["Targets:", ""]
    for sc in scenarios.values():
        for codec in sc.codecs:
            ceilings = {c: time_of(sc, c, codec) for c in PATTERN_CEILINGS}
            paced = time_of(sc, "tcp-paced", codec)
            deps = time_of(sc, "tcp-deps", codec)
            tcp_bound = time_of(sc, "tcp-prop", codec)
            floor = time_of(sc, "tcp-tls", codec)
            for impl in ("peerd", *DIRECT):
                t = time_of(sc, impl, codec)
                if t is None:
                    continue
                b = bound_s(sc, codec, args.numel)
                tcp = ("; the same bytes over plain TCP (equal parts): " + ", ".join(
                    f"{c} {b / ct:.2f}" for c, ct in ceilings.items() if ct)) if b and any(ceilings.values()) else ""
                if b and paced:
                    tcp += f"; tcp-prop's bytes, each connection paced at its share (tcp-paced): {b / paced:.2f}"
                if b and deps:
                    tcp += f"; a butterfly's order and dependency over paced TCP (tcp-deps): {b / deps:.2f}"
                if sc.key.startswith("wan"):
                    pattern = "tcp-ring" if impl == "peerd-ring" else "tcp"
                    ceiling = ceilings.get(pattern)
                    of_tcp = f", {ceiling / t:.2f} of {pattern} (target >= 0.97)" if ceiling else ""
                    met = b / t >= 0.90 and (ceiling is None or ceiling / t >= 0.97)
                    lines.append(f"- {sc.title}, {codec}, {impl}: link utilization {b / t:.2f} (target >= 0.90)"
                                 f"{of_tcp}: **{'met' if met else 'MISSED'}**{tcp}")
                elif sc.loopback:
                    gt = time_of(sc, "gloo", codec)
                    if gt:
                        lines.append(f"- {sc.title}, {codec}: {impl} {t / gt:.1f}x gloo (target <= 2.0x): "
                                     f"**{'met' if t / gt <= 2.0 else 'MISSED'}**"
                                     + (f"; the butterfly's bytes over TLS in blocking threads (tcp-tls), no "
                                        f"computation: {floor / gt:.1f}x gloo" if floor else ""))
                elif sc.key.startswith(("het", "asy")):
                    # parts follow measured rates only from the RATE_MIN_RUNS-th run on (the warm-up is run 1)
                    rated = by[(sc.key, impl, codec, sc.world)].times[
                        0 if impl == "peerd-ring" else RATE_MIN_RUNS - 1:]
                    proportional = WIRE_BYTES_PER_VALUE[codec] * args.numel * 8 / sc.slowest_bps
                    if not rated:
                        lines.append(f"- {sc.title}, {codec}, {impl}: no repetition with announced rates (needs "
                                     f"--reps >= {RATE_MIN_RUNS})")
                        continue
                    t = med(rated)
                    # the target: within 10% of the slow links' measured TCP bound (tcp-prop), where it ran
                    bound, name = ((tcp_bound, "the slow links' measured TCP bound (tcp-prop)") if tcp_bound else
                                   (proportional, "the bandwidth-proportional bound"))
                    lines.append(f"- {sc.title}, {codec}, {impl}: {t:.2f} s once rates are announced (repetitions "
                                 f">= {RATE_MIN_RUNS}), {t / bound:.2f}x {name} {bound:.2f} s (target <= 1.1x): "
                                 f"**{'met' if t <= 1.1 * bound else 'MISSED'}**; {t / proportional:.2f}x the "
                                 f"proportional bound {proportional:.1f} s{tcp}")
    return lines + [""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ifname", help=argparse.SUPPRESS)
    p.add_argument("--peer-hosts", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--rates-mbit", nargs="*", type=float, default=[], help=argparse.SUPPRESS)
    p.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--profile-to", help=argparse.SUPPRESS)
    p.add_argument("--profile-from", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS, help="codecs to measure")
    p.add_argument("--numel", type=int, default=25_000_000 // 4, help="fp32 values per peer (default 25 MB)")
    p.add_argument("--reps", type=int, default=3, help="measured repetitions per configuration (plus one warm-up)")
    p.add_argument("--rep-timeout-s", type=float, default=240.0, help="longest one repetition may take")
    p.add_argument("--peers", type=int, nargs="+", default=[4, 8], help="swarm sizes at 100 Mbit/s")
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--slow-mbit", type=float, default=20.0, help="rate of the two slow peers (heterogeneous)")
    p.add_argument("--slow-up-mbit", type=float, default=20.0,
                   help="upload rate of the two asymmetric peers (asym: download at --rate-mbit)")
    p.add_argument("--scenarios", nargs="+", default=["wan", "loopback", "hetero"],
                   choices=("wan", "loopback", "hetero", "asym"))
    p.add_argument("--impls", nargs="+", default=["peerd", "hivemind", "gloo"], choices=IMPLS)
    p.add_argument("--congestion", metavar="NAME",
                   help="TCP congestion control of the peers' data sockets (PEERD_TCP_CONGESTION, e.g. cubic, bbr; "
                        "default: the host's, /proc/sys/net/ipv4/tcp_congestion_control)")
    p.add_argument("--profile", metavar="DIR",
                   help="profile (cProfile, CPU time) each peerd worker's measured all-reduces, with the rest of its "
                        "event loop's work while they run, into DIR/SCENARIO-IMPL-rankR.prof (python -m pstats)")
    p.add_argument("--no-md", action="store_true", help="do not write the section into docs/benchmarks.md")
    p.add_argument("--md", default=os.path.join(REPO, "docs", "benchmarks.md"))
    args = p.parse_args()
    if args.worker:
        args.impl = args.worker
        worker_main(args)
        return 0
    if os.geteuid() != 0:
        print("bench_allreduce: needs root (network namespaces)", file=sys.stderr)
        return 2

    if args.congestion:  # the workers inherit it
        os.environ["PEERD_TCP_CONGESTION"] = args.congestion
    wt = load_wan_testbed()
    codecs = tuple(c for c in CODECS if c in args.codecs)
    scenarios: dict[str, Scenario] = {}
    if "wan" in args.scenarios:
        for n in args.peers:
            scenarios[f"wan{n}"] = Scenario(f"wan{n}", f"{n} peers at {args.rate_mbit:g} Mbit/s", n,
                                            [args.rate_mbit] * n, codecs)
    if "loopback" in args.scenarios:
        for n in args.peers:
            scenarios[f"lo{n}"] = Scenario(f"lo{n}", f"{n} peers on loopback (no shaping)", n, [], codecs)
    if "hetero" in args.scenarios:
        rates = [args.rate_mbit, args.rate_mbit, args.slow_mbit, args.slow_mbit]
        scenarios["het4"] = Scenario("het4", f"4 peers, heterogeneous: 2 at {args.rate_mbit:g} and 2 at "
                                     f"{args.slow_mbit:g} Mbit/s", 4, rates, codecs)
    if "asym" in args.scenarios:
        scenarios["asy4"] = Scenario("asy4", f"4 peers, asymmetric: all at {args.rate_mbit:g} Mbit/s down, 2 at "
                                     f"{args.slow_up_mbit:g} Mbit/s up", 4, [args.rate_mbit] * 4, codecs,
                                     [args.rate_mbit, args.rate_mbit, args.slow_up_mbit, args.slow_up_mbit])

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (`cmd &`)
    t0 = time.time()
    workdir = tempfile.mkdtemp(prefix="bench_allreduce_")
    print(f"logs in {workdir}", flush=True)
    rows: list[Row] = []
    name = f"ba{os.getpid() % 10**7}"
    for sc in scenarios.values():
        if sc.loopback:
            links = [wt.Link(None, None)]
        else:
            links = [wt.Link(*(r * 1e6 if r else None for r in sc.link_mbit(i))) for i in range(sc.world)]
        print(f"== {sc.title}", flush=True)
        with wt.Testbed(links, name=name) as tb:
            for impl in args.impls:
                rows += run_impl(tb, sc, impl, args, workdir)
    meta = {
        "command": ("sudo .venv/bin/python scripts/bench_allreduce.py "
                    + shlex.join(result_args(sys.argv[1:]))).strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_line(),
        "wall_s": time.time() - t0,
    }
    text = render(rows, scenarios, args, meta)
    print(text)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump([r.__dict__ for r in rows], f, indent=1)
    if not args.no_md:
        replace_section(args.md, SECTION, text)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
