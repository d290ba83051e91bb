#!/usr/bin/env python
"""Many DiLoCo workers on one machine: N real ``peerd join`` workers of the tiny model, one process tree each.

Each size runs in up to three modes in one invocation: ``process``, the baseline (each worker a fresh interpreter
with its DHT node in a child process: ``peerd join`` as a volunteer runs it by default); ``inline`` (``--dht
inline``: the DHT node in the worker's own event loop); ``preload`` (``--dht inline``, and each worker forked from a
process that already imported peerd, torch and hivemind, :class:`peerd.testing.localswarm.Swarm` with
``preload=True``: the imported modules' memory is shared copy-on-write).

A bootstrap node plus N workers of one run on 127.0.0.1, started together, each given the same run config (the tiny
model, :func:`run_config`; the first to look publishes it, the others read it), so that no worker trains ahead while
the others start; each worker does ``--rounds`` outer rounds and leaves. Reported per row: workers that reached the
last outer round and left, outer rounds completed (a joiner that downloaded the state of round k completes the
rounds after it) and failed attempts, group sizes of the completed rounds, how many workers ended each outer round
with each theta_outer digest, start-up time (launch until every worker logged its first inner step), peak memory in
use above the idle machine's, per worker, and the wall time.

A row stops early (reported as such) when the machine's available memory falls below ``--min-available-gb``: the
workers are killed before the kernel's OOM killer picks processes at random.

Run it inside a loopback-only namespace:
``unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/bench_workers.py --workers 16 64 --md docs/benchmarks.md'``
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402

from benchlib import machine_line, replace_section, result_args  # noqa: E402
from peerd.testing.localswarm import TINY, Swarm  # noqa: E402

HEADING = "## Many DiLoCo workers on one machine (scripts/bench_workers.py)"


def run_config(path: Path, rounds: int, inner_steps: int) -> Path:
    """The tiny test run with ``rounds`` outer rounds of ``inner_steps`` steps and timeouts for a loaded machine
    (matchmaking window 60 s, sender 60 s, reducer 120 s, state download 120 s; the test preset's are 15-20 s)."""
    text = TINY.read_text()
    text = text.replace("max_outer_rounds = 2", f"max_outer_rounds = {rounds}")
    text = text.replace("inner_steps = 10", f"inner_steps = {inner_steps}")
    text = text.replace("matchmaking_timeout_s = 15", "matchmaking_timeout_s = 60")
    text = text.replace("request_timeout_s = 3", "request_timeout_s = 15")
    text = text.replace("sender_timeout_s = 10", "sender_timeout_s = 60").replace("reducer_timeout_s = 20",
                                                                                 "reducer_timeout_s = 120")
    text = text.replace("download_timeout_s = 20", "download_timeout_s = 120")
    path.write_text(text)
    return path


MODES = ("process", "inline", "preload")


def run_one(n: int, mode: str, args: argparse.Namespace) -> dict:
    """Start a bootstrap node and ``n`` workers in ``mode`` (one of :data:`MODES`); returns the row."""
    dht = "process" if mode == "process" else "inline"
    workdir = Path(tempfile.mkdtemp(prefix=f"bench_workers_{n}_{mode}_"))
    config = run_config(workdir / "run.toml", args.rounds, args.inner_steps)
    idle = psutil.virtual_memory()
    base_used = idle.total - idle.available
    swarm = Swarm(workdir, preload=mode == "preload")
    launched = time.time()
    peak, started_all, stopped = 0, None, None
    try:
        swarm.start_bootstrap(120.0)
        status = {"PEERD_STATUS_INTERVAL_S": str(args.status_interval_s), "PEERD_STATUS_TTL_S": str(args.status_ttl_s)}
        for i in range(n):  # all with the same run config: whoever comes first publishes it, nobody trains ahead
            swarm.start_peer(f"w{i}", "scale", config, "--dht", dht, env=status)
        deadline = time.time() + args.timeout_s
        while time.time() < deadline:
            mem = psutil.virtual_memory()
            peak = max(peak, mem.total - mem.available - base_used)
            if mem.available < args.min_available_gb * 2**30:
                stopped = f"stopped: {mem.available / 2**30:.1f} GiB available"
                break
            if started_all is None and all(p.of("inner") for p in swarm.peers):
                started_all = time.time() - launched
            if all(p.proc.poll() is not None for p in swarm.peers):
                break
            time.sleep(1.0)
        else:
            stopped = f"stopped after {args.timeout_s:g} s"
    except KeyboardInterrupt:  # Ctrl-C ends this row; what it had is reported
        stopped = "interrupted"
    finally:
        swarm.close()
    return summarize(swarm.peers, n, mode, args.rounds, {
        "startup_s": started_all, "peak_gb": peak / 1e9, "per_worker_mb": peak / n / 1e6,
        "wall_s": time.time() - launched, "stopped": stopped})


def summarize(peers: list, n: int, mode: str, rounds_target: int, measured: dict) -> dict:
    """The row of one run from its workers' JSON logs (``peers``: :class:`peerd.testing.localswarm.Peer`) and
    ``measured`` (start-up, memory, wall time, why it stopped)."""
    rounds = [e for p in peers for e in p.of("outer_round")]
    left = [p.of("leave")[-1] for p in peers if p.of("leave")]
    by_round: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in rounds:
        by_round[e["outer_round"]][e["digest"]] += 1
    return {
        "workers": n, "mode": mode, "finished": sum(1 for e in left if e.get("outer_round", 0) >= rounds_target),
        "rounds": len(rounds), "failed": sum(len(p.of("round_failed")) for p in peers),
        "sizes": dict(collections.Counter(e.get("group_size") for e in rounds)),
        "digests": {r: sorted(c.values(), reverse=True) for r, c in sorted(by_round.items())},
        **measured,
    }


def fmt_row(row: dict) -> str:
    total = sum(row["sizes"].values()) or 1
    sizes = ", ".join(f"{k}: {100 * v / total:.0f}%" for k, v in sorted(row["sizes"].items(), key=lambda kv: kv[0] or 0))
    groups = "; ".join(f"r{r}: {'+'.join(map(str, c))}" for r, c in row["digests"].items())
    startup = f"{row['startup_s']:.0f}" if row["startup_s"] is not None else "-"
    return (f"| {row['workers']} | {row['mode']} | {row['finished']}/{row['workers']} | {row['rounds']} / "
            f"{row['failed']} | {sizes or '-'} | {groups or '-'} | {startup} | {row['peak_gb']:.1f} | "
            f"{row['per_worker_mb']:.0f} | {row['wall_s']:.0f} | {row['stopped'] or 'finished'} |")


def report(rows: list[dict], args: argparse.Namespace) -> str:
    cmd = " ".join(["unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/bench_workers.py",
                    *result_args(sys.argv[1:])]) + "'"
    return "\n".join([
        HEADING, "", f"Command: `{cmd}`  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}  ",
        f"Machine: {machine_line()}. One run per row on a shared 2-core machine.", "",
        f"Setup: a bootstrap node and N `peerd join` workers (one process tree each: the worker, its p2pd and, in "
        f"mode process, the DHT child process and torch's shared-memory manager; mode inline: `--dht inline`; mode "
        f"preload: `--dht inline`, forked from a process that imported peerd, torch and hivemind) of the tiny model (0.9M "
        f"parameters, `node_configs/runs/tiny-test.toml` with {args.rounds} outer rounds of {args.inner_steps} inner "
        f"steps and timeouts for a loaded machine), 1 torch thread each, status records every "
        f"{args.status_interval_s:g} s with a {args.status_ttl_s:g} s TTL, all started together with that run config, "
        f"on 127.0.0.1. Memory = peak of the "
        f"machine's memory in use (total - available) above what was in use before the row started, / N. "
        f"\"Same theta_outer\" lists, per outer round, how many workers ended it with each digest (one number = all "
        f"the workers that completed that round agree).", "",
        "| workers | mode | finished all rounds | outer rounds done / failed | group sizes | same theta_outer "
        "(workers per digest) | start-up s | peak GB | MB per worker | wall s | end |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *map(fmt_row, rows),
    ]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[16, 64], help="swarm sizes")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="modes to run per size (process is the baseline)")
    p.add_argument("--full-up-to", type=int, default=16,
                   help="run modes process and inline only up to this many workers (at 64 they need ~38 GB and "
                   "~29 GB, more than this 24 GiB machine has)")
    p.add_argument("--rounds", type=int, default=3, help="outer rounds per worker")
    p.add_argument("--inner-steps", type=int, default=20, help="inner steps per outer round (H)")
    p.add_argument("--status-interval-s", type=float, default=5.0,
                   help="workers' status_interval_s (the node default; the test preset's 1 s loads a busy machine)")
    p.add_argument("--status-ttl-s", type=float, default=30.0, help="workers' status_ttl_s (the node default)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="a row is stopped after this long")
    p.add_argument("--min-available-gb", type=float, default=1.0,
                   help="stop a row when available memory falls below this (GiB)")
    p.add_argument("--md", default=None, help="replace this section in that markdown file")
    args = p.parse_args()
    runs = [(n, mode) for n in args.workers for mode in args.modes if mode == "preload" or n <= args.full_up_to]
    rows = []
    for n, mode in runs:
        rows.append(run_one(n, mode, args))
        print(fmt_row(rows[-1]), flush=True)
        if rows[-1]["stopped"] == "interrupted":
            break
    section = report(rows, args)
    print(section)
    if args.md:
        replace_section(args.md, HEADING, section)


if __name__ == "__main__":
    main()
