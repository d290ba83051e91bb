#!/usr/bin/env python
"""Where the time of one butterfly all-reduce goes, in one process: N peers, one all-reduce of S bytes of fp32 each,
under cProfile; prints the wall time, the CPU time (user + system: robust to a loaded machine) and the functions with
the most own time.

Transports: ``inprocess`` (peerd.transport.inprocess, no sockets: its pipes copy every byte as a socket would, but
through asyncio.StreamReader), ``direct`` (the direct data plane, real TCP on 127.0.0.1, one connection per stream)
and ``mux`` (the same with warm multiplexed connections), discovery and fallback on an in-process hub.

Usage: ``python scripts/profile_allreduce.py --peers 4 --mbytes 25 --codec none --transport mux --top 15``
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


async def _transports(n: int, kind: str) -> tuple[list, list]:
    """``(transports, direct streams to stop)`` of ``n`` peers on transport ``kind``."""
    import types

    from peerd.transport.inprocess import Hub

    hub = Hub()
    if kind == "inprocess":
        return [hub.transport(f"peer{i:02d}") for i in range(n)], []
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from peerd.identity.signing import Signer
    from peerd.transport.direct import DirectStreams
    from peerd.transport.records import SignedDiscovery

    transports, direct = [], []
    for _ in range(n):
        signer = Signer(Ed25519PrivateKey.generate())
        inner = hub.transport(signer.peer_id)
        discovery = SignedDiscovery(inner.discovery, signer)
        streams = DirectStreams(inner.streams, discovery, signer, "127.0.0.1", multiplex=kind == "mux")
        await streams.start()
        direct.append(streams)
        transports.append(types.SimpleNamespace(discovery=discovery, streams=streams))
    return transports, direct


async def _round(n: int, numel: int, codec: str, reps: int, profiler=None,
                 kind: str = "inprocess") -> tuple[list[float], float]:
    import torch

    from protocols.allreduce import AllReduceConfig, ButterflyAllReduce
    from protocols.matchmaking import MatchmakingConfig, Matchmaker

    transports, direct = await _transports(n, kind)
    peers = []
    for transport in transports:
        mm = Matchmaker(transport, "prof", MatchmakingConfig(10.0, 2.0, 0.05))
        ar = ButterflyAllReduce(transport, "prof", AllReduceConfig(codec, 60.0, 120.0))
        await mm.start()
        await ar.start()
        peers.append((mm, ar))
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    seconds, cpu = [], 0.0
    for rep in range(reps):
        groups = await asyncio.gather(*[mm.form_group(f"r{rep}", {}, expected_size=n) for mm, _ in peers])
        started, cpu_started = time.perf_counter(), time.process_time()
        if profiler is not None:
            profiler.enable()
        await asyncio.gather(*[ar.run(g, x, 1.0) for (_, ar), g, x in zip(peers, groups, xs)])
        if profiler is not None:
            profiler.disable()
        seconds.append(time.perf_counter() - started)
        cpu += time.process_time() - cpu_started
    for streams in direct:
        await streams.stop()
    return seconds, cpu


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--mbytes", type=float, default=25.0, help="fp32 MB per peer")
    p.add_argument("--codec", default="none")
    p.add_argument("--reps", type=int, default=3, help="all-reduces profiled (after one warm-up)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--transport", choices=("inprocess", "direct", "mux"), default="inprocess")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="event loop (the daemon runs on uvloop where it is installed)")
    p.add_argument("--no-profile", action="store_true", help="only the timed all-reduces")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    numel = int(a.mbytes * 1e6 / 4)
    if a.loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(_round(a.peers, numel, a.codec, 1, kind=a.transport))  # warm-up
    seconds, cpu = asyncio.run(_round(a.peers, numel, a.codec, a.reps, kind=a.transport))  # without the profiler
    print(f"{a.peers} peers x {a.mbytes:g} MB fp32, codec {a.codec}, transport {a.transport}, {a.loop}: all-reduce {min(seconds):.3f} s (best of "
          f"{a.reps}), CPU {cpu:.2f} s for {a.reps} all-reduces, {cpu / a.reps / (a.peers * a.mbytes):.4f} "
          f"CPU s per MB averaged")
    if a.no_profile:
        return 0
    profiler = cProfile.Profile(time.process_time)  # CPU time: robust to a loaded machine
    asyncio.run(_round(a.peers, numel, a.codec, a.reps, profiler, kind=a.transport))
    pstats.Stats(profiler).sort_stats("tottime").print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
