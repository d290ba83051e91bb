#!/usr/bin/env python
"""Where the time of one butterfly all-reduce goes, in one process: N in-process peers (peerd.transport.inprocess,
no sockets), one all-reduce of S bytes of fp32 each, under cProfile; prints the wall time, the CPU time and the
functions with the most own time. The in-process pipes copy every byte once (feed_data), as a socket would.

Usage: ``python scripts/profile_allreduce.py --peers 4 --mbytes 25 --codec none --top 15``
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


async def _round(n: int, numel: int, codec: str, reps: int, profiler=None) -> tuple[list[float], float]:
    import torch

    from peerd.transport.inprocess import Hub
    from protocols.allreduce import AllReduceConfig, ButterflyAllReduce
    from protocols.matchmaking import MatchmakingConfig, Matchmaker

    hub = Hub()
    peers = []
    for i in range(n):
        transport = hub.transport(f"peer{i:02d}")
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
    return seconds, cpu


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--mbytes", type=float, default=25.0, help="fp32 MB per peer")
    p.add_argument("--codec", default="none")
    p.add_argument("--reps", type=int, default=3, help="all-reduces profiled (after one warm-up)")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    numel = int(a.mbytes * 1e6 / 4)
    asyncio.run(_round(a.peers, numel, a.codec, 1))  # warm-up
    seconds, cpu = asyncio.run(_round(a.peers, numel, a.codec, a.reps))  # timed without the profiler
    print(f"{a.peers} peers x {a.mbytes:g} MB fp32, codec {a.codec}: all-reduce {min(seconds):.3f} s (best of "
          f"{a.reps}), CPU {cpu:.2f} s for {a.reps} all-reduces, {cpu / a.reps / (a.peers * a.mbytes):.4f} "
          f"CPU s per MB averaged")
    profiler = cProfile.Profile()
    asyncio.run(_round(a.peers, numel, a.codec, a.reps, profiler))
    pstats.Stats(profiler).sort_stats("tottime").print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
