#!/usr/bin/env python
"""Many peers: matchmaking success, group sizes, round times, memory and start-up vs the number of peers.

Real runs: a bootstrap node plus N light averaging peers (``python -m peerd.testing.avgpeer --peers 8``: 8 peers per
process, each peer its own p2pd and an in-process DHT node) run ``--rounds`` rounds of ``--topology`` (Moshpit with
target group size 4 by default; ``allreduce``: one butterfly all-reduce of everyone, target group size N;
``gossip``: pairwise exchanges with 2 random partners, no groups), arriving at every round spread over ``--jitter-s``
seconds, on 127.0.0.1. Reported: share of successful rounds (gossip: rounds with at least one exchange), the
group-size distribution (gossip: exchanges per peer-round), round time p50/p95, peak memory (RSS of every process
tree, bootstrap included) per peer, and start-up time (launch until every peer logged ``start``).

Simulated runs: :mod:`peerd.testing.sim` (the same Matchmaker / all-reduce / Moshpit code on the in-process transport,
in virtual time, log-normal link latency and bandwidth), each size in a child process bounded by ``--sim-timeout-s``.
Round times are virtual seconds; memory is the child's peak RSS per peer.

Run it inside a loopback-only namespace:
``unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/bench_scale.py --real 16 32 64 --sim 100 1000 10000'``
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402

from benchlib import machine_line, replace_section, result_args  # noqa: E402
from peerd.testing.localswarm import Swarm  # noqa: E402

HEADING = "## Many peers: matchmaking and memory at scale (scripts/bench_scale.py)"
PER_PROCESS = 8


_SETUP = {
    "moshpit": "Moshpit averaging, target group size 4",
    "allreduce": "one butterfly all-reduce of every peer per round (target group size N: the rendezvous waits for "
                 "the peers of each one's view; late peers form the next group)",
    "gossip": "pairwise gossip, 2 random partners per peer per round (no groups)",
}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _tree_rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            family = [proc] + proc.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for p in family:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
    return total


def run_real(n: int, args: argparse.Namespace) -> dict:
    """One real run of ``n`` light peers; returns its row."""
    workdir = Path(tempfile.mkdtemp(prefix=f"bench_scale_{n}_"))
    swarm = Swarm(workdir)
    launched = time.time()
    peak_rss, started_all = 0, None
    try:
        maddr = swarm.start_bootstrap()
        procs = []
        for first in range(0, n, PER_PROCESS):
            argv = [sys.executable, "-m", "peerd.testing.avgpeer", "--index", str(first),
                    "--peers", str(min(PER_PROCESS, n - first)), "--expect", str(n), "--topology", args.topology,
                    "--group-size", "4", "--rendezvous", args.rendezvous, "--rounds", str(args.rounds),
                    "--numel", str(args.numel),
                    "--compression", "fp16", "--out", str(workdir / "a{index}.jsonl"), "--initial-peers", maddr,
                    "--matchmaking-timeout-s", str(args.matchmaking_timeout_s), "--arrival-jitter-s", str(args.jitter_s),
                    "--max-wait-s", str(args.max_wait_s), "--timeout-s", "30", "--member-ttl-s", "30",
                    "--start-timeout-s", str(args.start_timeout_s)]
            procs.append(swarm.start_process(f"p{first}", argv))
        pids = [swarm._bootstrap.pid] + [p.proc.pid for p in procs]
        deadline = time.time() + args.real_timeout_s
        while time.time() < deadline and any(p.proc.poll() is None for p in procs):
            peak_rss = max(peak_rss, _tree_rss(pids))
            if started_all is None:
                starts = sum(1 for i in range(n) if (workdir / f"a{i}.jsonl").exists()
                             and '"start"' in (workdir / f"a{i}.jsonl").read_text())
                if starts == n:
                    started_all = time.time() - launched
            time.sleep(1.0)
        finished = all(p.proc.poll() is not None for p in procs)
    finally:
        swarm.close()
    rounds = []
    for i in range(n):
        path = workdir / f"a{i}.jsonl"
        if path.exists():
            rounds += [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == "round"]
    ok = [r for r in rounds if r["ok"]]
    size_of = "exchanges" if args.topology == "gossip" else "group_size"
    return {
        "kind": "real" if args.topology == "moshpit" else f"real, {args.topology}", "peers": n, "finished": finished,
        "rounds": len(rounds), "expected_rounds": n * args.rounds,
        "ok": len(ok), "sizes": dict(collections.Counter(r[size_of] for r in ok)),
        "p50_s": _percentile([r["seconds"] for r in ok], 0.5), "p95_s": _percentile([r["seconds"] for r in ok], 0.95),
        "mem_per_peer_mb": peak_rss / n / 2**20, "startup_s": started_all, "wall_s": time.time() - launched,
        "errors": dict(collections.Counter(r.get("error", "")[:70] for r in rounds if not r["ok"]).most_common(3)),
    }


def run_sim_child(n: int, rounds: int, numel: int) -> None:
    """In a child: simulate ``n`` peers and print one JSON row."""
    from peerd.testing.sim import simulate_moshpit

    res = simulate_moshpit(n, rounds, group_size=4, numel=numel)
    sizes: collections.Counter = collections.Counter()
    for r in res.rounds:
        sizes.update(r.group_sizes)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({
        "kind": "sim", "peers": n, "finished": True, "rounds": sum(r.peers for r in res.rounds),
        "expected_rounds": n * rounds, "ok": sum(r.succeeded for r in res.rounds), "sizes": dict(sizes),
        "p50_s": _percentile([r.seconds_p50 for r in res.rounds], 0.5),
        "p95_s": max(r.seconds_p95 for r in res.rounds), "mem_per_peer_mb": peak / n / 2**20,
        "startup_s": None, "wall_s": res.wall_s, "virtual_s": res.virtual_s,
        "consensus": [r.consensus for r in res.rounds],
    }))


def run_curves_child(args: argparse.Namespace) -> None:
    """In a child: Moshpit's convergence under each failure rate and gossip's consensus decay; prints one JSON line.

    Spreads are sum_i ||x_i - mean||^2 over the peers alive after each round, divided by the initial spread."""
    from peerd.testing.sim import gossip_rate_per_exchange, initial_vectors, peer_names, simulate_gossip, \
        simulate_moshpit, spread

    n, g = args.curve_peers, args.gossip_peers
    start = spread(list(initial_vectors(peer_names(n), args.sim_numel, 0).values()))
    moshpit = {}
    for rate in args.failure_rates:
        res = simulate_moshpit(n, args.curve_rounds, group_size=4, numel=args.sim_numel, failure_rate=rate,
                               matchmaking_timeout_s=5.0)
        moshpit[str(rate)] = {"spread": [1.0] + [r.consensus / start for r in res.rounds],
                              "alive": [n] + [r.peers for r in res.rounds],
                              "ok": [r.succeeded for r in res.rounds]}
    gstart = spread(list(initial_vectors(peer_names(g), args.sim_numel, 0).values()))
    res, exchanges = simulate_gossip(g, args.gossip_rounds, partners=1, numel=args.sim_numel)
    print(json.dumps({"moshpit_peers": n, "moshpit": moshpit, "gossip_peers": g,
                      "gossip_spread": [1.0] + [r.consensus / gstart for r in res.rounds],
                      "gossip_exchanges": [0] + [sum(exchanges[:i + 1]) for i in range(len(exchanges))],
                      "gossip_rate": gossip_rate_per_exchange(g)}))


def run_curves(args: argparse.Namespace) -> Optional[dict]:
    argv = [sys.executable, os.path.abspath(__file__), "--curves-child", "--sim-numel", str(args.sim_numel),
            "--curve-peers", str(args.curve_peers), "--curve-rounds", str(args.curve_rounds),
            "--gossip-peers", str(args.gossip_peers), "--gossip-rounds", str(args.gossip_rounds),
            "--failure-rates", *map(str, args.failure_rates)]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=args.sim_timeout_s)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError):
        return None


def run_sim(n: int, args: argparse.Namespace) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--sim-child", str(n), "--rounds", str(args.sim_rounds),
            "--sim-numel", str(args.sim_numel)]
    started = time.time()
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=args.sim_timeout_s)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError):
        return {"kind": "sim", "peers": n, "finished": False, "wall_s": time.time() - started}


def fmt_row(row: dict) -> str:
    if not row.get("finished") and not row.get("rounds"):
        return (f"| {row['kind']} | {row['peers']} | did not finish within {row['wall_s']:.0f} s | | | | | | |")
    total = sum(row["sizes"].values()) or 1
    sizes = ", ".join(f"{k}: {100 * v / total:.0f}%" for k, v in sorted(row["sizes"].items(), key=lambda kv: int(kv[0])))
    unit = "s" if row["kind"].startswith("real") else "virtual s"
    startup = f"{row['startup_s']:.0f}" if row.get("startup_s") is not None else "-"
    return (f"| {row['kind']} | {row['peers']} | {row['ok']}/{row['expected_rounds']} "
            f"({100 * row['ok'] / max(1, row['expected_rounds']):.1f}%) | {sizes} | {row['p50_s']:.2f} {unit} | "
            f"{row['p95_s']:.2f} {unit} | {row['mem_per_peer_mb']:.1f} | {startup} | {row['wall_s']:.0f} |")


def report(rows: list[dict], args: argparse.Namespace, png_rel: Optional[str]) -> str:
    cmd = " ".join(["unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/bench_scale.py",
                    *result_args(sys.argv[1:])]) + "'"
    out = [HEADING, "", f"Command: `{cmd}`  ", f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}  ",
           f"Machine: {machine_line()}. Numbers from a shared, loaded 2-core machine: compare rows of one run only.", "",
           f"Setup: {_SETUP[args.topology]}, {args.rounds} rounds (simulated rows: Moshpit, "
           f"{args.sim_rounds}). Real rows: light peers "
           f"(`peerd.testing.avgpeer --peers {PER_PROCESS}`: {PER_PROCESS} peers per process, each with its own p2pd and "
           f"an in-process DHT node), {args.numel} fp16 values, arrivals at each rendezvous spread over "
           f"{args.jitter_s:g} s, matchmaking idle window {args.matchmaking_timeout_s:g} s (cap {args.max_wait_s:g} s); "
           f"memory = peak RSS of every process tree (bootstrap included) / N. Simulated rows: `peerd.testing.sim` "
           f"(the same protocol code on the in-process transport, virtual time, log-normal latency median 30 ms and "
           f"uplink median 100 Mbit/s), {args.sim_numel} fp32 values, the sharded rendezvous (every peer matchmakes only "
           f"with its groupmates); memory = the simulator process's peak RSS / N. "
           "Group sizes are shares of successful peer-rounds (gossip: exchanges per peer-round); on a 4 x 4 x 2 grid (32 peers) one round in three has "
           "groups of 2 by construction, likewise 16 = 4 x 4 and 64 = 4 x 4 x 4 give groups of 4 only.", "",
           "| kind | peers | successful peer-rounds | group sizes | round p50 | round p95 | MB per peer | start-up s | wall s |",
           "|---|---|---|---|---|---|---|---|---|"]
    out += [fmt_row(r) for r in rows]
    errors = [f"- {r['kind']} {r['peers']}: {r['errors']}" for r in rows if r.get("errors")]
    if errors:
        out += ["", "Failed rounds (most common errors):", *errors]
    if png_rel:
        out += ["", f"![matchmaking success, group sizes, round time and memory per peer vs peers; Moshpit convergence "
                f"under failures; gossip consensus decay]({png_rel})"]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], curves: Optional[dict], png: str) -> bool:
    """Six panels: matchmaking success, group-size shares, round time and memory per peer vs N; Moshpit's convergence
    under failure rates; gossip's consensus decay against the spectral-gap prediction."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    (ok_ax, size_ax, time_ax), (mem_ax, mosh_ax, gossip_ax) = axes
    done = [r for r in rows if r.get("rounds")]
    for kind, marker in (("real", "o"), ("sim", "s")):
        mine = [r for r in done if r["kind"] == kind]
        xs = [r["peers"] for r in mine]
        ok_ax.plot(xs, [100 * r["ok"] / r["expected_rounds"] for r in mine], marker=marker, label=kind)
        mem_ax.plot(xs, [r["mem_per_peer_mb"] for r in mine], marker=marker, label=kind)
        unit = "s" if kind == "real" else "virtual s"
        time_ax.plot(xs, [r["p50_s"] for r in mine], marker=marker, label=f"{kind} p50 ({unit})")
        time_ax.plot(xs, [r["p95_s"] for r in mine], marker=marker, linestyle="--", label=f"{kind} p95 ({unit})")
    for ax, label in ((ok_ax, "successful peer-rounds (%)"), (mem_ax, "MB per peer (peak RSS / N)"),
                      (time_ax, "round time")):
        ax.set_xscale("log")
        ax.set_xlabel("peers")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    ok_ax.set_ylim(0, 105)
    time_ax.set_yscale("log")
    mem_ax.set_yscale("log")
    ok_ax.set_title("Moshpit matchmaking success")
    time_ax.set_title("round time (real: wall; simulated: virtual)")
    mem_ax.set_title("memory per peer")

    labels = [f"{r['kind']}\n{r['peers']}" for r in done]
    bottom = [0.0] * len(done)
    for size in sorted({int(k) for r in done for k in r["sizes"]}, reverse=True):
        share = [100 * r["sizes"].get(str(size), r["sizes"].get(size, 0)) / max(1, sum(r["sizes"].values()))
                 for r in done]
        size_ax.bar(labels, share, bottom=bottom, label=f"group of {size}")
        bottom = [b + v for b, v in zip(bottom, share)]
    size_ax.set_ylabel("share of successful peer-rounds (%)")
    size_ax.set_title("group sizes (target 4)")
    size_ax.legend(fontsize=8)

    if curves:
        for rate, c in curves["moshpit"].items():
            floor = 1e-16  # an exact average is 0: drawn at the float floor
            mosh_ax.plot(range(len(c["spread"])), [max(v, floor) for v in c["spread"]], marker="o",
                         label=f"{100 * float(rate):g}% of peers fail per round")
        mosh_ax.set_yscale("log")
        mosh_ax.set_xlabel("round")
        mosh_ax.set_ylabel("spread / initial spread")
        mosh_ax.set_title(f"Moshpit convergence, {curves['moshpit_peers']} simulated peers, groups of 4")
        mosh_ax.legend(fontsize=8)
        ex = curves["gossip_exchanges"]
        gossip_ax.plot(ex, curves["gossip_spread"], marker="o", label="simulated (1 partner per peer per round)")
        gossip_ax.plot(ex, [curves["gossip_rate"] ** k for k in ex], linestyle="--",
                       label=f"(1 - 1/(N-1))^exchanges, N = {curves['gossip_peers']}")
        gossip_ax.set_yscale("log")
        gossip_ax.set_xlabel("pairwise exchanges")
        gossip_ax.set_ylabel("spread / initial spread")
        gossip_ax.set_title("gossip consensus decay vs spectral gap")
        gossip_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", type=int, nargs="*", default=[16, 32], help="real light-peer swarm sizes")
    p.add_argument("--sim", type=int, nargs="*", default=[100, 1000], help="simulated swarm sizes")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--numel", type=int, default=10_000, help="values per real peer")
    p.add_argument("--sim-numel", type=int, default=16, help="values per simulated peer")
    p.add_argument("--sim-rounds", type=int, default=None, help="rounds of the simulated rows (default --rounds)")
    p.add_argument("--topology", choices=("moshpit", "allreduce", "gossip"), default="moshpit",
                   help="real rows: what the peers run (simulated rows are always Moshpit)")
    p.add_argument("--rendezvous", choices=("round", "group"), default="round",
                   help="real rows: Moshpit's rendezvous (the simulated rows always use the sharded one, group)")
    p.add_argument("--jitter-s", type=float, default=4.0, help="real: arrivals spread over this many seconds")
    p.add_argument("--matchmaking-timeout-s", type=float, default=2.0)
    p.add_argument("--max-wait-s", type=float, default=60.0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--real-timeout-s", type=float, default=600.0, help="a real run is stopped after this long")
    p.add_argument("--sim-timeout-s", type=float, default=600.0, help="a simulated size is stopped after this long")
    p.add_argument("--md", default=None, help="append/replace the section in this markdown file")
    p.add_argument("--plot", "--png", dest="png", default=None,
                   help="draw the plot here, e.g. docs/images/scale.png (needs matplotlib: pip install '.[bench]')")
    p.add_argument("--curve-peers", type=int, default=256, help="simulated peers of the Moshpit convergence curves")
    p.add_argument("--curve-rounds", type=int, default=8, help="rounds of the Moshpit convergence curves")
    p.add_argument("--failure-rates", type=float, nargs="*", default=[0.0, 0.02, 0.1],
                   help="Moshpit curves: share of the alive peers that crash in each round (none: no curves)")
    p.add_argument("--gossip-peers", type=int, default=64, help="simulated peers of the gossip decay curve")
    p.add_argument("--gossip-rounds", type=int, default=8)
    p.add_argument("--json", default=None, help="also write the rows and curves here (JSON)")
    p.add_argument("--rows-from", default=None,
                   help="take the rows from a --json file of an earlier run instead of running --real/--sim again")
    p.add_argument("--sim-child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--curves-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.sim_child is not None:
        run_sim_child(args.sim_child, args.rounds, args.sim_numel)
        return
    if args.curves_child:
        run_curves_child(args)
        return
    if args.sim_rounds is None:
        args.sim_rounds = args.rounds
    if any(n < 2 for n in args.real + args.sim) or args.rounds < 1 or args.sim_rounds < 1:
        p.error("swarm sizes must be >= 2, --rounds and --sim-rounds >= 1")
    if args.curve_peers < 2 or args.gossip_peers < 3 or args.curve_rounds < 1 or args.gossip_rounds < 1:
        p.error("--curve-peers >= 2, --gossip-peers >= 3, --curve-rounds and --gossip-rounds >= 1")
    if any(not 0.0 <= f < 1.0 for f in args.failure_rates):
        p.error("--failure-rates must be in [0, 1)")
    rows = []
    if args.rows_from:
        with open(args.rows_from) as f:
            rows = json.load(f)["rows"]
    for n in [] if args.rows_from else args.real:
        rows.append(run_real(n, args))
        print(fmt_row(rows[-1]), flush=True)
    for n in [] if args.rows_from else args.sim:
        rows.append(run_sim(n, args))
        print(fmt_row(rows[-1]), flush=True)
    curves = run_curves(args) if args.png and args.failure_rates else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "curves": curves}, f, indent=1)
    png_rel = None
    if args.png and plot(rows, curves, args.png):
        png_rel = os.path.relpath(args.png, os.path.dirname(os.path.abspath(args.md)) if args.md else ".")
    text = report(rows, args, png_rel)
    print(text)
    if args.md:
        replace_section(args.md, HEADING, text)


if __name__ == "__main__":
    main()
