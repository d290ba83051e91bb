#!/usr/bin/env python3
"""A DiLoCo worker's resident memory over many outer rounds, with and without returning freed heap memory to the OS.

Two real ``peerd join`` workers of the tiny model (process mode, one torch thread each) and a bootstrap node on
127.0.0.1 run ``--rounds`` outer rounds of ``--inner-steps`` steps, first with ``PEERD_TRIM_HEAP=0`` (the baseline:
glibc keeps what a round freed), then as shipped (:func:`peerd.runtime.heap.trim_heap`, ``malloc_trim(0)`` after every outer
round). Reported per mode: each worker's RSS (the worker process, not its p2pd or DHT child) after rounds 1, 10, 20,
..., and the last.

Run it inside a loopback-only namespace:
``unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/bench_worker_rss.py --rounds 60 --md docs/benchmarks.md'``
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402

from bench_workers import run_config  # noqa: E402
from benchlib import machine_line, replace_section, result_args  # noqa: E402
from peerd.runtime.heap import TRIM_ENV  # noqa: E402
from peerd.testing.localswarm import Swarm  # noqa: E402

HEADING = "## Worker memory over outer rounds (scripts/bench_worker_rss.py)"
MODES = {"no trim (baseline)": "0", "malloc_trim after each round": "1"}


def run_one(trim: str, args: argparse.Namespace) -> dict[str, dict[int, float]]:
    """{worker: {outer round: RSS MB}} of one mode."""
    workdir = Path(tempfile.mkdtemp(prefix="bench_worker_rss_"))
    config = run_config(workdir / "run.toml", args.rounds, args.inner_steps)
    swarm = Swarm(workdir)
    try:
        swarm.start_bootstrap()
        peers = [swarm.start_peer(f"w{i}", "rss", config, "--threads", "1", env={TRIM_ENV: trim})
                 for i in range(2)]
        samples: dict[str, dict[int, float]] = {p.name: {} for p in peers}
        deadline = time.time() + args.timeout_s
        while time.time() < deadline and any(p.proc.poll() is None for p in peers):
            for p in peers:
                done = max((e["outer_round"] for e in p.of("outer_round")), default=0)
                if done and done not in samples[p.name] and p.proc.poll() is None:
                    samples[p.name][done] = psutil.Process(p.proc.pid).memory_info().rss / 1e6
            time.sleep(0.2)
        return samples
    finally:
        swarm.close()


def report(results: dict[str, dict[str, dict[int, float]]], args: argparse.Namespace) -> str:
    marks = sorted({1, args.rounds, *range(10, args.rounds + 1, 10)})
    lines = [
        HEADING, "",
        "Command: `unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/bench_worker_rss.py "
        + " ".join(result_args(sys.argv[1:])) + "'`  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}  ",
        f"Machine: {machine_line()}.", "",
        f"Setup: 2 `peerd join` workers of the tiny model (`node_configs/runs/tiny-test.toml` with {args.rounds} outer "
        f"rounds of {args.inner_steps} inner steps and bench_workers.py's timeouts), 1 torch thread each, on "
        "127.0.0.1; RSS of each worker process (MB) after the outer round named; a blank: the sample fell between two "
        "rounds.", "",
        "| mode | worker | " + " | ".join(f"r{m}" for m in marks) + " |",
        "|---|---|" + "---|" * len(marks),
    ]
    for mode, samples in results.items():
        for worker, rss in samples.items():
            lines.append(f"| {mode} | {worker} | " + " | ".join(f"{rss[m]:.0f}" if m in rss else "" for m in marks)
                         + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=60, help="outer rounds per worker")
    p.add_argument("--inner-steps", type=int, default=2, help="inner steps per outer round (H)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="a mode is stopped after this long")
    p.add_argument("--md", default=None, help="replace this section in that markdown file")
    args = p.parse_args()
    results = {mode: run_one(trim, args) for mode, trim in MODES.items()}
    section = report(results, args)
    print(section)
    if args.md:
        replace_section(args.md, HEADING, section)


if __name__ == "__main__":
    main()
