#!/usr/bin/env python3
"""Host memory of a DiLoCo peer's outer round: measured against the prediction of
``peerd/hardware/host_memory.py`` and against the round without its buffer handover, in the same run.

Each variant runs in a fresh interpreter: two DiLoCo workers of one preset in one process (the in-process transport,
a group of two, the all-reduce's default fp16 codec) train ``--rounds`` outer rounds of 2 inner steps on the CPU; a
thread samples the process's resident memory every 2 ms. Per round: the peak during the two workers' round boundary
(from the start of the first ``boundary_round`` to the end of the last: what the training loop waits for) above the
resident memory just before it, halved (per worker). Variants: ``peerd`` (the round writes the pseudo-gradient, the
all-reduce's average and the new theta_outer into theta_local's copy: ``owned=True`` with ``retake_local``),
``handover`` (the same without ``retake_local``: the average in a buffer of its own, as before 2026-11-27),
``baseline`` (``owned=False``: a fresh pseudo-gradient, average and theta_outer, as before the handover) and
``alone`` (one worker, ``min_group_size = 1``: its group of one returns the pseudo-gradient itself). The prediction
is the round term of :func:`peerd.hardware.host_memory.host_estimate` for the variant's group (theta_local's copy,
which takes the average too, the new momentum, the butterfly's own part; alone, the copy and the new momentum); the
checkpoint's copy comes after the outer step and is smaller.

``.venv/bin/python scripts/bench_host_memory.py --preset 125m --rounds 4 --md docs/benchmarks.md``
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import machine_line, replace_section, result_args  # noqa: E402

HEADING = "## An outer round's host memory (scripts/bench_host_memory.py)"
#: variant -> (the round hands theta_local's copy on: ``owned``, and can take it again: ``retake_local``,
#: workers = the group's size)
VARIANTS = {"baseline": (False, False, 2), "handover": (True, False, 2), "peerd": (True, True, 2),
            "alone": (True, True, 1)}
CODEC = "fp16"


def measure(preset: str, rounds: int, handover: bool, retake: bool, workers_n: int = 2) -> dict:
    """Run ``workers_n`` workers (a group of that size) in this process; per round, the per-worker rise of the
    resident memory in bytes."""
    import psutil
    import torch

    from peerd.config import NodeConfig
    from peerd.roles.base import RunContext
    from peerd.roles.diloco import DiLoCoRole
    from peerd.run_config import AveragingConfig, RunConfig
    from peerd.transport.inprocess import Hub
    from protocols.diloco import DiLoCoHyperparams

    torch.set_num_threads(1)
    run = RunConfig(model=preset, seq_len=32, batch_size=2, eval_batches=0, max_outer_rounds=rounds,
                    diloco=DiLoCoHyperparams(inner_steps=2, warmup_steps=1, inner_lr=1e-3),
                    averaging=AveragingConfig.from_flat(compression=CODEC, min_group_size=workers_n,
                                                        matchmaking_timeout_s=60.0))
    hub = Hub()
    tmp = tempfile.mkdtemp(prefix="bench-host-memory-")
    workers = [DiLoCoRole(RunContext.build("bench-host-memory", run, NodeConfig(
        checkpoint_dir=os.path.join(tmp, f"w{i}"), threads=1, device="cpu"), hub.transport(f"w{i}")))
        for i in range(workers_n)]
    proc, samples, done, marks = psutil.Process(), [], threading.Event(), []

    def sample() -> None:
        while not done.is_set():
            samples.append((time.perf_counter(), proc.memory_info().rss))
            time.sleep(0.002)

    for w in workers:
        inner_round, boundary_round = w.sync.round, w.boundary_round  # what the training loop awaits

        async def sync_round(local, weight, live, syncing, owned=False, digest=True, retake_local=None,
                             inner_round=inner_round):
            return await inner_round(local, weight, live, syncing, owned and handover, digest,
                                     retake_local if retake else None)

        async def timed_round(boundary_round=boundary_round) -> None:
            marks.append(("start", time.perf_counter()))
            await boundary_round()
            marks.append(("end", time.perf_counter()))

        w.sync.round, w.boundary_round = sync_round, timed_round
    threading.Thread(target=sample, daemon=True).start()

    async def main() -> None:
        await asyncio.gather(*(w.run() for w in workers))

    asyncio.run(main())
    done.set()
    starts = [t for kind, t in marks if kind == "start"]
    ends = [t for kind, t in marks if kind == "end"]
    rises = []
    for r in range(0, min(len(starts), len(ends)) - workers_n + 1, workers_n):
        begin, end = min(starts[r:r + workers_n]), max(ends[r:r + workers_n])
        before = max([v for t, v in samples if begin - 0.3 <= t <= begin] or [0])
        peak = max(v for t, v in samples if begin <= t <= end)
        rises.append((peak - before) / workers_n)
    return {"parameters": workers[0].part.outer.numel, "rises": rises}


def run_variant(preset: str, rounds: int, variant: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", preset, str(rounds), variant],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="125m", help="dense preset (default 125m: 4 bytes a parameter = 0.5 GB)")
    ap.add_argument("--rounds", type=int, default=4, help="outer rounds per variant (the first is left out)")
    ap.add_argument("--md", help="write the section into this markdown file")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        preset, rounds, variant = args.child
        print(json.dumps(measure(preset, int(rounds), *VARIANTS[variant])))
        return 0
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (the first round is left out)")
    from peerd.hardware.host_memory import host_estimate

    rows = {}
    for variant in VARIANTS:
        result = run_variant(args.preset, args.rounds, variant)
        steady = result["rises"][1:]  # the first round also allocates what later rounds reuse
        rows[variant] = (result["parameters"], steady)
        print(f"{variant}: per-worker rise at the boundary " + ", ".join(f"{r / result['parameters']:.1f}"
                                                                         for r in result["rises"])
              + " bytes a parameter (rounds 1..n)", flush=True)
    p = rows["peerd"][0]
    predicted = {variant: host_estimate(p, device_type="cpu", codec=CODEC, group_size=workers).round
                 for variant, (_, _, workers) in VARIANTS.items()}
    unpredicted = {"baseline": " + 8.0 (no handover) + 4.0 (the average's own buffer)",
                   "handover": " + 4.0 (the average's own buffer)"}
    lines = [HEADING, "",
             f"{datetime.date.today().isoformat()}, {machine_line()}.", "",
             f"`{' '.join(['.venv/bin/python', 'scripts/bench_host_memory.py', *result_args(sys.argv[1:])])}`", "",
             f"Two `{args.preset}` workers (P = {p:,}) on the CPU in one process, a group of two, {CODEC} all-reduce "
             "(`alone`: one worker, a group of one); the peak resident memory of each worker's round boundary above "
             f"the memory just before it, rounds 2 to {args.rounds}. Predicted: the round term of "
             "`peerd/hardware/host_memory.py` for the variant's group.", "",
             "| variant | per-worker rise, bytes a parameter (median, range) | GiB | predicted |", "|---|---|---|---|"]
    for variant in VARIANTS:
        _, steady = rows[variant]
        per = [r / p for r in steady]
        lines.append(f"| {variant} | {statistics.median(per):.1f} ({min(per):.1f}-{max(per):.1f}) | "
                     f"{statistics.median(steady) / (1 << 30):.2f} | "
                     f"{predicted[variant] / p:.1f}" + unpredicted.get(variant, "") + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        replace_section(args.md, HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
