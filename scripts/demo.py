"""The local demo: 1 bootstrap node + N ``peerd join --run-id demo`` workers on 127.0.0.1, then a summary."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from peerd.testing.localswarm import ROOT, Swarm

RUN_CONFIG = ROOT / "node_configs" / "runs" / "shakespeare-demo.toml"
LN2 = 0.6931471805599453


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=5.0, help="training time before the peers are stopped")
    parser.add_argument("--peers", type=int, default=3, help="number of workers")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, checkpoints) afterwards")
    parser.add_argument("--dashboard-port", type=int, default=8477, metavar="PORT",
                        help="the first peer serves the web dashboard on 127.0.0.1:PORT (default 8477; 0 = any free)")
    parser.add_argument("--screenshot", metavar="PNG",
                        help="save a screenshot of the dashboard (headless chromium) two thirds into the demo")
    args = parser.parse_args()
    if args.minutes <= 0 or args.peers < 1:
        parser.error("--minutes must be > 0 and --peers >= 1")

    workdir = Path(tempfile.mkdtemp(prefix="peerd-demo-"))
    swarm = Swarm(workdir)
    try:
        maddr = swarm.start_bootstrap()
        print(f"bootstrap node: {maddr}")
        peers = [swarm.start_peer(f"peer{i}", "demo", RUN_CONFIG, "--threads", "1",
                                  *(["--dashboard-port", str(args.dashboard_port)] if i == 0 else []))
                 for i in range(args.peers)]
        print(f"{args.peers} peers joining run 'demo' ({RUN_CONFIG.relative_to(ROOT)}); logs in {workdir}")
        print(f"watch them from another shell: .venv/bin/peerd status --run-id demo --initial-peers {maddr}")
        swarm.wait_for(lambda: peers[0].of("dashboard") or peers[0].proc.poll() is not None, 120,
                       "the dashboard of peer0")
        dashboard = peers[0].of("dashboard")
        if dashboard:
            print(f"or in a browser: {dashboard[0]['url']}  (peer0's dashboard: the run, its curves, and pause/resume "
                  "of peer0)\n")
        deadline = time.time() + args.minutes * 60
        shot_at = time.time() + args.minutes * 40 if args.screenshot and dashboard else None
        last_print = 0.0
        while time.time() < deadline:
            if shot_at is not None and time.time() >= shot_at:
                shot_at = None
                _screenshot(dashboard[0]["url"], args.screenshot)
            if any(p.proc.poll() is not None for p in peers):
                print("a peer exited early:\n" + swarm.tails(), file=sys.stderr)
                return 1
            if time.time() - last_print >= 15:
                last_print = time.time()
                _progress(peers, deadline)
            time.sleep(1)
        print("\ntime is up: stopping the peers (each finishes or abandons its round, checkpoints, leaves)")
        for p in peers:
            p.proc.send_signal(signal.SIGINT)
        codes = [swarm.wait_exit(p, 90) for p in peers]
        _summary(peers)
        return 0 if all(c == 0 for c in codes) else 1
    finally:
        swarm.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _screenshot(url: str, path: str) -> None:
    """Headless chromium's own screenshot of the page, after 8 s of the page's (virtual) time."""
    import subprocess

    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        print("no chromium found: no screenshot", file=sys.stderr)
        return
    argv = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--window-size=1500,960",
            "--virtual-time-budget=8000", f"--screenshot={Path(path).resolve()}", url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    print(f"screenshot of the dashboard: {path}" if done.returncode == 0 else
          f"screenshot failed: {done.stderr[-500:]}", file=sys.stderr)


def _progress(peers, deadline) -> None:
    parts = []
    for p in peers:
        inner = p.of("inner")
        rounds = p.of("outer_round")
        if not inner and not rounds:
            parts.append(f"{p.name}: starting")
            continue
        last = inner[-1] if inner else {"outer_round": len(rounds), "inner_step": 0, "loss": float("nan")}
        parts.append(f"{p.name}: round {last['outer_round'] + 1} step {last['inner_step']} loss {last['loss']:.3f}")
    evals = [e["eval_nats_per_byte"] for p in peers for e in p.of("outer_round")[-1:] if e.get("eval_nats_per_byte")]
    tail = f" | eval {evals[-1]:.3f} nats/byte" if evals else ""
    print(f"[{max(0, deadline - time.time()):4.0f} s left] " + " | ".join(parts) + tail, flush=True)


def _summary(peers) -> None:
    first = [e["eval_nats_per_byte"] for p in peers for e in p.of("eval")[:1] if e.get("eval_nats_per_byte")]
    last = [e["eval_nats_per_byte"] for p in peers for e in p.of("outer_round")[-1:] if e.get("eval_nats_per_byte")]
    print("\n=== summary ===")
    if first and last:
        print(f"eval loss (held-out plays): {first[0]:.4f} -> {min(last):.4f} nats/byte "
              f"({first[0] / LN2:.3f} -> {min(last) / LN2:.3f} bits/byte)")
    total_sent = total_dp = 0
    for p in peers:
        rounds = p.of("outer_round")
        sent = sum(e["bytes_sent"] for e in rounds)
        dp = sum(e["dp_equivalent_bytes"] for e in rounds)
        total_sent, total_dp = total_sent + sent, total_dp + dp
        failed = p.of("leave")[-1]["rounds_failed"] if p.of("leave") else "?"
        print(f"{p.name}: {len(rounds)} outer rounds ({failed} failed), sent {sent / 1e6:.1f} MB; per-step "
              f"data-parallel all-reduce would have sent {dp / 1e6:.1f} MB for the same tokens")
    digests = {p.digests().get(max(p.digests(), default=0)) for p in peers}
    print(f"peers agree on theta_outer: {'yes' if len(digests) == 1 else 'no (rounds differ at stop)'}")
    if total_sent:
        print(f"communication: {total_sent / 1e6:.1f} MB vs {total_dp / 1e6:.1f} MB "
              f"({total_dp / total_sent:.0f}x less than per-step data parallelism)")


if __name__ == "__main__":
    sys.exit(main())
