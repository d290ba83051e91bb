#!/usr/bin/env python
"""Benchmark: averaging topologies (all-reduce, moshpit, gossip) among real peers on 127.0.0.1.

Part 1, consensus. N real averaging peers (``python -m peerd.testing.avgpeer``, each its own process tree: python, hivemind
DHT child, p2pd) start from different random vectors (``randn(numel)`` seeded by the peer's index) and run rounds of
one topology. After every round each peer logs a *sketch* of its vector (the values at 4096 fixed coordinates, the
same on every peer). The consensus distance of round r is estimated from the sketches of the peers that logged round
r: mean over peers of ||s_i - mean|| / ||mean|| (``protocols.gossip.consensus_distance`` on the sketches; the full
vectors are compared too, once, on the saved final vectors). Every topology and N is run twice: undisturbed, and
with one peer (not index 0) SIGKILLed (its whole process tree) right after it logged round 2; then the distance is
over the survivors, and the error of the survivors' mean vs the initial mean of *all* peers shows the mass that died
with the victim.

Part 2, training. N = 4 real ``peerd join`` daemons per topology train the tiny model with DiLoCo on Shakespeare
(same hyperparameters, same tokens per peer); eval nats/byte vs training tokens and bytes sent, from the daemons'
JSON events (approach and helpers of scripts/bench_diloco.py).

Results replace the section ``SECTION_HEADING`` of docs/benchmarks.md (other sections are kept); plots go to
docs/bench_averaging.png (consensus) and docs/bench_averaging_diloco.png (eval loss). ``--quick`` is a smoke run
that writes no files unless --md/--png are given.

Everything listens on 127.0.0.1 only (avgpeer and the bootstrap bind 127.0.0.1; daemons get --host-maddrs
/ip4/127.0.0.1/tcp/0). Every child leads its own process group and is killed (tree and group) on exit, Ctrl-C and
SIGTERM included.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (REPO, os.path.join(REPO, "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import psutil  # noqa: E402
import torch  # noqa: E402

from bench_diloco import _fmt_bytes, _machine, _toml_value  # noqa: E402
from peerd.testing.avgpeer import initial_vector, sketch_indices  # noqa: E402
from peerd.run_config import load_run_config  # noqa: E402
from peerd.testing.localswarm import ProcessSet, Swarm, kill_tree, pump_lines  # noqa: E402
from protocols.diloco import DiLoCoHyperparams  # noqa: E402
from protocols.gossip import consensus_distance  # noqa: E402
from protocols.moshpit import Grid  # noqa: E402

from benchlib import replace_section  # noqa: E402

SECTION_HEADING = "## Averaging topologies (scripts/bench_averaging.py)"
LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"
TOPOLOGIES = ("allreduce", "moshpit", "gossip")
REPORT_ROUNDS = (1, 2, 4, 8)
KILL_AFTER_ROUND = 2
LOAD_AT_START = "?"
PLOT_FLOOR = 1e-9
"""Exact consensus (distance 0, e.g. bit-identical all-reduce results) is drawn at this value on the log plot."""


# ---------------------------------------------------------------------------------------------------------------
# Part 1: consensus among avgpeer processes


@dataclass(frozen=True)
class AvgSpec:
    topology: str
    peers: int
    kill: bool
    compression: str
    rounds: int
    group_size: int
    partners: int

    @property
    def label(self) -> str:
        kill = ", 1 killed" if self.kill else ""
        comp = "" if self.compression == "fp16" else f", {self.compression}"
        return f"{self.topology} N={self.peers}{kill}{comp}"

    @property
    def name(self) -> str:
        return f"{self.topology}-n{self.peers}-{'kill' if self.kill else 'ok'}-{self.compression}"


@dataclass
class AvgResult:
    spec: AvgSpec
    records: dict[int, list[dict]] = field(default_factory=dict)
    """peer index -> its ``round`` records, in order."""
    victim: Optional[int] = None
    victim_last_round: Optional[int] = None
    wall_s: Optional[float] = None
    distance: dict[int, float] = field(default_factory=dict)
    """round (0 = the initial vectors) -> sketch estimate of the consensus distance over the peers that logged it."""
    live_count: dict[int, int] = field(default_factory=dict)
    full_final_distance: Optional[float] = None
    """Consensus distance of the survivors' saved final vectors (full numel, not a sketch)."""
    sketch_final_distance: Optional[float] = None
    """The sketch estimate on the same final vectors, to check the estimate."""
    error_vs_initial_mean: Optional[float] = None
    """||mean of the survivors' final vectors - mean of all peers' initial vectors|| / ||that initial mean||."""
    error_floor: Optional[float] = None
    """Same for the survivors' own initial mean: what 'forgetting the victim from the start' would give."""
    bytes_per_peer_round: Optional[float] = None
    logged_bytes_per_peer_round: Optional[float] = None
    median_round_s: Optional[float] = None
    max_round_s: Optional[float] = None
    failed_rounds: int = 0
    group_sizes: list[int] = field(default_factory=list)
    ok: bool = False
    notes: list[str] = field(default_factory=list)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by SIGKILL
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _rounds_of(path: Path) -> list[dict]:
    return [r for r in _read_jsonl(path) if r.get("event") == "round"]


def run_avg(spec: AvgSpec, args: argparse.Namespace, workdir: str) -> AvgResult:
    """One swarm: bootstrap + ``spec.peers`` avgpeer processes until every survivor exits (or the run times out)."""
    result = AvgResult(spec)
    rundir = Path(workdir) / spec.name
    rundir.mkdir(parents=True)
    swarm = Swarm(rundir)
    procs: list[subprocess.Popen] = []
    outs = [rundir / f"a{i}.jsonl" for i in range(spec.peers)]
    victim = (spec.peers // 2 + 1) if spec.kill else None  # not index 0 (nothing special about 0, but keep it)
    result.victim = victim
    t0 = time.perf_counter()
    try:
        maddr = swarm.start_bootstrap(timeout_s=args.bootstrap_timeout_s)
        for i in range(spec.peers):
            argv = [sys.executable, "-m", "peerd.testing.avgpeer", "--index", str(i), "--expect", str(spec.peers),
                    "--topology", spec.topology, "--rounds", str(spec.rounds), "--out", str(outs[i]),
                    "--initial-peers", maddr, "--run-id", f"bench-{spec.name}", "--numel", str(args.numel),
                    "--compression", spec.compression, "--group-size", str(spec.group_size),
                    "--partners", str(spec.partners), "--timeout-s", str(args.timeout_s),
                    "--matchmaking-timeout-s", str(args.matchmaking_timeout_s),
                    "--start-timeout-s", str(args.start_timeout_s), "--member-ttl-s", str(args.member_ttl_s),
                    "--linger-s", str(args.linger_s)]
            procs.append(swarm.start_process(f"a{i}", argv).proc)
            time.sleep(args.stagger_s)  # 16 pythons importing torch + hivemind at once starve 2 cores
        deadline = time.monotonic() + args.run_timeout_s
        if victim is not None:
            while time.monotonic() < deadline:
                if any(r.get("round") == KILL_AFTER_ROUND for r in _rounds_of(outs[victim])):
                    kill_tree(procs[victim].pid)
                    break
                if procs[victim].poll() is not None:
                    result.notes.append(f"victim {victim} exited (rc={procs[victim].poll()}) before round "
                                        f"{KILL_AFTER_ROUND}")
                    break
                time.sleep(0.02)
            else:
                result.notes.append(f"victim {victim} never logged round {KILL_AFTER_ROUND}")
        survivors = [i for i in range(spec.peers) if i != victim]
        for i in survivors:
            try:
                rc = procs[i].wait(max(0.1, deadline - time.monotonic()))
                if rc != 0:
                    result.notes.append(f"peer {i} exited with code {rc}")
            except subprocess.TimeoutExpired:
                result.notes.append(f"timed out after {args.run_timeout_s:.0f} s; peer {i} still running")
                break
        result.wall_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a failed run is reported, the others still run
        result.notes.append(f"failed: {type(e).__name__}: {e}")
        result.wall_s = time.perf_counter() - t0
    finally:
        swarm.close()  # whole trees and process groups: also the helpers a killed leader orphaned
    result.records = {i: _rounds_of(outs[i]) for i in range(spec.peers)}
    if victim is not None and result.records[victim]:
        result.victim_last_round = max(r["round"] for r in result.records[victim])
    _analyze_avg(result, args, outs)
    return result


def _analyze_avg(result: AvgResult, args: argparse.Namespace, outs: list[Path]) -> None:
    spec, notes = result.spec, result.notes
    idx = sketch_indices(args.numel)
    initial = [initial_vector(i, args.numel) for i in range(spec.peers)]
    result.distance[0] = consensus_distance([v[idx] for v in initial])
    result.live_count[0] = spec.peers
    # moshpit peers that fell behind skip ahead (round_to_join), so round numbers can exceed spec.rounds
    last_round = max([spec.rounds] + [int(rec.get("round", 0)) for recs in result.records.values() for rec in recs])
    for r in range(1, last_round + 1):
        sketches = [torch.tensor(rec["sketch"]) for recs in result.records.values() for rec in recs
                    if rec.get("round") == r and "sketch" in rec]
        if sketches:
            result.distance[r] = consensus_distance(sketches)
            result.live_count[r] = len(sketches)
    all_recs = [rec for recs in result.records.values() for rec in recs]
    if not all_recs:
        notes.append("no round records")
        return
    result.failed_rounds = sum(1 for rec in all_recs if not rec.get("ok"))
    sent = sum(int(rec.get("bytes_sent") or 0) for rec in all_recs)
    result.logged_bytes_per_peer_round = sent / len(all_recs)
    if spec.topology == "gossip":
        # A gossip round record counts only the exchanges this peer initiated; what it sent as a responder is in
        # no record. The responder's sent bytes are the initiator's received bytes, so swarm total = sum of both.
        received = sum(int(rec.get("bytes_received") or 0) for rec in all_recs)
        result.bytes_per_peer_round = (sent + received) / len(all_recs)
    else:
        result.bytes_per_peer_round = result.logged_bytes_per_peer_round
    seconds = [float(rec["seconds"]) for rec in all_recs if "seconds" in rec]
    result.median_round_s = statistics.median(seconds)
    result.max_round_s = max(seconds)
    key = "exchanges" if spec.topology == "gossip" else "group_size"
    result.group_sizes = [int(rec[key]) for rec in all_recs if rec.get(key) is not None and rec.get("ok")]
    survivors = [i for i in range(spec.peers) if i != result.victim]
    finals = []
    for i in survivors:
        path = Path(f"{outs[i]}.final.pt")
        if path.exists():
            finals.append(torch.load(path))
    if len(finals) == len(survivors):
        result.full_final_distance = consensus_distance(finals)
        result.sketch_final_distance = consensus_distance([f[idx] for f in finals])
        m0 = torch.stack(initial).mean(0)
        surv_mean = torch.stack(finals).mean(0)
        result.error_vs_initial_mean = float((surv_mean - m0).norm() / m0.norm())
        surv_m0 = torch.stack([initial[i] for i in survivors]).mean(0)
        result.error_floor = float((surv_m0 - m0).norm() / m0.norm())
    else:
        notes.append(f"only {len(finals)} of {len(survivors)} survivors saved a final vector")
    for i in survivors:
        got = len(result.records[i])
        if got != spec.rounds:
            notes.append(f"peer {i} logged {got} of {spec.rounds} rounds")
    if spec.kill:
        if result.victim_last_round is None or result.victim_last_round >= spec.rounds:
            notes.append("the kill did not happen mid-run")
        else:
            notes.append(f"peer {result.victim} killed after logging round {result.victim_last_round}")
    result.ok = (len(finals) == len(survivors) and all(len(result.records[i]) == spec.rounds for i in survivors)
                 and not any(n.startswith(("failed", "timed out", "the kill")) for n in notes))
    if result.failed_rounds:
        errors = sorted({_failure(rec) for rec in all_recs if not rec.get("ok")})
        notes.append(f"{result.failed_rounds} failed peer-rounds: {'; '.join(errors[:4])}")
    if spec.topology == "allreduce":  # one group per round: members must all succeed or all fail
        for r in range(1, spec.rounds + 1):
            oks = [bool(rec.get("ok")) for recs in result.records.values() for rec in recs if rec.get("round") == r]
            if any(oks) and not all(oks):
                notes.append(f"round {r}: {oks.count(False)} of {len(oks)} peers failed while the others completed "
                             f"the same all-reduce (non-atomic round; the failed peers keep their own vector)")


def _failure(rec: dict) -> str:
    if rec.get("error"):
        return str(rec["error"])[:160]
    return f"0 exchanges (busy {rec.get('busy')}, failed {rec.get('failed')})"


# ---------------------------------------------------------------------------------------------------------------
# Part 2: DiLoCo with each topology (real peerd daemons)


@dataclass
class DilocoResult:
    topology: str
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(training tokens of all peers together, mean eval nats/byte over the peers that logged that round)."""
    initial_eval: Optional[float] = None
    peer_evals: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per peer: (outer round, eval nats/byte) of its outer_round events."""
    final_evals: list[float] = field(default_factory=list)
    """Each peer's eval after its last outer round (peers differ under moshpit and gossip)."""
    bytes_per_peer: Optional[float] = None
    logged_bytes_per_peer: Optional[float] = None
    wall_s: Optional[float] = None
    rounds_logged: list[int] = field(default_factory=list)
    rounds_failed: int = 0
    group_sizes: list[int] = field(default_factory=list)
    ok: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def final(self) -> Optional[float]:
        return sum(self.final_evals) / len(self.final_evals) if self.final_evals else None


def write_run_config(path: str, args: argparse.Namespace, topology: str) -> None:
    hp = DiLoCoHyperparams(inner_lr=args.inner_lr, warmup_steps=args.warmup_steps)
    top = dict(model="tiny", seq_len=args.seq_len, batch_size=args.batch_size, dataset="shakespeare", seed=0,
               max_outer_rounds=args.diloco_rounds, eval_batches=args.eval_batches)
    diloco = {**hp.to_dict(), "inner_steps": args.H}
    # all-reduce needs everyone (as in bench_diloco); a moshpit group is 2 peers; gossip has no groups.
    min_group = {"allreduce": args.diloco_peers, "moshpit": 2, "gossip": 1}[topology]
    averaging = dict(method=topology, compression="fp16", group_size=2, gossip_partners=2, min_group_size=min_group,
                     matchmaking_timeout_s=args.diloco_matchmaking_timeout_s, request_timeout_s=10.0,
                     sender_timeout_s=30.0, reducer_timeout_s=60.0)
    lines = [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    for name, table in (("diloco", diloco), ("averaging", averaging)):
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    load_run_config(path)  # the daemon's own schema check, before any process starts


def run_diloco(topology: str, args: argparse.Namespace, workdir: str) -> DilocoResult:
    """``diloco_peers`` peerd daemons until ``max_outer_rounds``; everything read from their JSON logs."""
    n = args.diloco_peers
    result = DilocoResult(topology)
    rundir = os.path.join(workdir, f"diloco-{topology}")
    os.makedirs(rundir)
    config_path = os.path.join(rundir, "run.toml")
    write_run_config(config_path, args, topology)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PEERD_THREADS="1")
    children = ProcessSet()
    events: list[list[dict]] = [[] for _ in range(n)]
    lock = threading.Lock()

    def on_peer_line(i: int, line: str) -> None:
        try:
            rec = json.loads(line)
        except ValueError:
            return
        if not isinstance(rec, dict) or "event" not in rec:
            return
        with lock:
            events[i].append(rec)
        if i == 0 and rec["event"] == "outer_round":
            print(f"  [{topology}] round {rec.get('outer_round')}/{args.diloco_rounds} group={rec.get('group_size')} "
                  f"eval={rec.get('eval_nats_per_byte')}", flush=True)

    t0 = None
    try:
        boot = children.start(
            [args.peerd, "bootstrap", "--host-maddrs", LOOPBACK_MADDR, "--identity", os.path.join(rundir, "boot.key")],
            stdout=subprocess.PIPE, stderr=open(os.path.join(rundir, "bootstrap.err"), "w"), text=True, env=env)
        maddrs: queue.Queue[str] = queue.Queue()
        pump_lines(boot.stdout, os.path.join(rundir, "bootstrap.out"), maddrs.put)
        initial_peer = None
        deadline = time.monotonic() + args.bootstrap_timeout_s
        while initial_peer is None:
            try:
                line = maddrs.get(timeout=0.5).strip()
            except queue.Empty:
                if boot.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"bootstrap printed no /ip4/127.0.0.1/.../p2p/ address (rc={boot.poll()}); "
                                       f"see {rundir}/bootstrap.err") from None
                continue
            if line.startswith("/ip4/127.0.0.1/") and "/p2p/" in line:
                initial_peer = line
        t0 = time.perf_counter()
        peers = []
        for i in range(n):
            p = children.start(
                [args.peerd, "join", "--run-id", f"bench-avg-{topology}-{os.getpid()}", "--run-config", config_path,
                 "--initial-peers", initial_peer, "--identity", os.path.join(rundir, f"peer{i}.key"),
                 "--checkpoint-dir", os.path.join(rundir, f"ckpt{i}"), "--host-maddrs", LOOPBACK_MADDR,
                 "--threads", "1", "--log-format", "json"],
                stdout=open(os.path.join(rundir, f"peer{i}.out"), "w"), stderr=subprocess.PIPE, text=True, env=env)
            pump_lines(p.stderr, os.path.join(rundir, f"peer{i}.err"), lambda line, i=i: on_peer_line(i, line))
            peers.append(p)
        deadline = time.monotonic() + args.run_timeout_s
        while any(p.poll() is None for p in peers):
            failed = [i for i, p in enumerate(peers) if p.poll() not in (None, 0)]
            if failed:
                time.sleep(5)
                result.notes.append(f"peer(s) {failed} exited with code(s) {[peers[i].poll() for i in failed]}")
                break
            if time.monotonic() > deadline:
                result.notes.append(f"timed out after {args.run_timeout_s:.0f} s; peers still running: "
                                    f"{[i for i, p in enumerate(peers) if p.poll() is None]}")
                break
            time.sleep(0.2)
        result.wall_s = time.perf_counter() - t0
        time.sleep(0.5)  # let the log pumps drain
    except Exception as e:  # noqa: BLE001
        result.notes.append(f"failed: {type(e).__name__}: {e}")
        if t0 is not None:
            result.wall_s = time.perf_counter() - t0
    finally:
        children.stop()
    with lock:
        _summarize_diloco(result, events, args)
    if not result.ok:
        result.notes.append(f"logs in {rundir}")
    return result


def _summarize_diloco(result: DilocoResult, events: list[list[dict]], args: argparse.Namespace) -> None:
    notes = result.notes
    by_round: dict[int, list[dict]] = {}
    sent_total, received_total = 0, 0
    for i, evs in enumerate(events):
        done = [e for e in evs if e.get("event") == "outer_round"]
        result.rounds_logged.append(len(done))
        result.rounds_failed += sum(1 for e in evs if e.get("event") == "round_failed")
        for e in done:
            by_round.setdefault(int(e["outer_round"]), []).append(e)
            result.group_sizes.append(int(e.get("group_size") or 0))
        sent_total += sum(int(e.get("bytes_sent") or 0) for e in done)
        received_total += sum(int(e.get("bytes_received") or 0) for e in done)
        last = [e for e in done if e.get("eval_nats_per_byte") is not None]
        result.peer_evals.append([(int(e["outer_round"]), float(e["eval_nats_per_byte"])) for e in last])
        if last:
            result.final_evals.append(float(last[-1]["eval_nats_per_byte"]))
        if done and int(done[-1]["outer_round"]) != args.diloco_rounds:
            notes.append(f"peer {i} ended at outer round {done[-1]['outer_round']}")
    result.logged_bytes_per_peer = sent_total / len(events)
    # gossip: an outer_round event counts only the exchanges this peer initiated (see part 1)
    result.bytes_per_peer = (sent_total + received_total if result.topology == "gossip" else sent_total) / len(events)
    initial = [e.get("eval_nats_per_byte") for evs in events for e in evs
               if e.get("event") == "eval" and e.get("outer_round") == 0]
    if initial:
        result.initial_eval = float(initial[0])
        result.curve.append((0, float(initial[0])))
    for r in sorted(by_round):
        recs = by_round[r]
        evals = [float(e["eval_nats_per_byte"]) for e in recs if e.get("eval_nats_per_byte") is not None]
        if evals and len(recs) == len(events):  # only rounds every peer logged: same token count for every topology
            result.curve.append((sum(int(e.get("tokens") or 0) for e in recs), sum(evals) / len(evals)))
    if result.rounds_failed:
        notes.append(f"{result.rounds_failed} round_failed events over all peers")
    skipped = [args.diloco_rounds - k for k in result.rounds_logged if k < args.diloco_rounds]
    if skipped:
        notes.append(f"outer_round events per peer: {result.rounds_logged} (of {args.diloco_rounds})")
    result.ok = bool(result.final_evals) and len(result.final_evals) == len(events) and not any(
        n.startswith(("failed", "timed out", "peer(s)")) for n in notes)


# ---------------------------------------------------------------------------------------------------------------
# Report


def _fmt_dist(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0 (exact)"
    return f"{x:.2g}" if x < 0.01 else f"{x:.3f}"


def _expected_live(r: AvgResult, rnd: int) -> int:
    killed = r.victim is not None and r.victim_last_round is not None and rnd > r.victim_last_round
    return r.spec.peers - (1 if killed else 0)


def _dist_cell(r: AvgResult, rnd: int) -> str:
    """The distance of round ``rnd``, marked when fewer peers than were alive logged that round (moshpit skips)."""
    if rnd not in r.distance:
        return "-"
    live, expected = r.live_count[rnd], _expected_live(r, rnd)
    return _fmt_dist(r.distance[rnd]) + (f" [{live}/{expected} peers]" if live < expected else "")


def _last_round(r: AvgResult) -> Optional[int]:
    """The last round logged by at least two peers (a lone peer's 'consensus' says nothing)."""
    return max((k for k, n in r.live_count.items() if n >= 2), default=None)


def _kill_cell(r: AvgResult) -> str:
    if not r.spec.kill:
        return "no"
    return f"yes (peer {r.victim} after r{r.victim_last_round})" if r.victim_last_round else "yes (did not fire)"


def make_markdown(avg: list[AvgResult], dl: list[DilocoResult], args: argparse.Namespace, command: str, date: str,
                  total_wall_s: float, png_rel: Optional[str], png2_rel: Optional[str]) -> str:
    out = [SECTION_HEADING, "",
           f"Command: `{command}`  ",
           f"Date: {date}  ",
           f"Machine: {_machine()}; load average {LOAD_AT_START} at the start (other work shared the 2 cores, so "
           f"the seconds are inflated)  ",
           f"Whole benchmark: {total_wall_s:.0f} s wall.", ""]
    if avg:
        rounds_cols = " | ".join(f"r{r}" for r in REPORT_ROUNDS)
        out += [
            "### Consensus among averaging peers", "",
            f"Setup: N real peers (`python -m peerd.testing.avgpeer`, each its own process tree with a hivemind DHT and p2pd) "
            f"on 127.0.0.1, each starting from its own `randn({args.numel:,})` vector; codec on the wire as in the "
            f"table (fp16 unless noted). Topologies: allreduce = one butterfly all-reduce among all live peers per "
            f"round; moshpit = grid groups of M (M = {args.group_size_8} for N=8: grid "
            f"{_grid(8, args.group_size_8)}; M = {args.group_size_16} for N=16: grid {_grid(16, args.group_size_16)}); "
            f"gossip = push-pull pair exchanges with k = {args.partners} random partners per round (no barrier: "
            f"'round r' of gossip is each peer's own r-th round, not a common instant). {args.rounds} rounds for "
            f"allreduce/moshpit, {args.gossip_rounds} for gossip. Kill: SIGKILL of one peer's whole process tree right "
            f"after it logged round {KILL_AFTER_ROUND}. Timeouts: matchmaking {args.matchmaking_timeout_s:g} s, "
            f"all-reduce / exchange {args.timeout_s:g} s, member TTL {args.member_ttl_s:g} s.", "",
            "Consensus distance = mean over peers of ||x_i - mean|| / ||mean||, **estimated from each peer's 4096-"
            "coordinate sketch** (the same coordinates on every peer) over the peers that logged that round (after a "
            "kill: the survivors; '[k/n peers]' marks a round that only k of the n live peers logged, because moshpit peers "
            "that fell behind skip rounds). r0 is the initial vectors (~sqrt(N-1)). 'full final' is the exact full-vector "
            "distance of the survivors' saved final vectors (gossip peers keep serving exchanges after their own last "
            "round, so theirs can be lower than the last sketch). 'error vs initial mean' = ||mean of the survivors' "
            "final vectors - mean of all N initial vectors|| / ||that mean||: with a kill, the mass that died with the "
            "victim (in brackets: the error if the victim had never existed, i.e. the survivors' own initial mean).",
            "",
            f"| topology | N | killed? | {rounds_cols} | last round | full final | error vs initial mean | "
            f"bytes sent per peer per round | median / max round s | group size (or exchanges) | failed peer-rounds | "
            f"wall s |",
            "|---|---|---|" + "---|" * len(REPORT_ROUNDS) + "---|---|---|---|---|---|---|---|"]
        for r in avg:
            s = r.spec
            cells = " | ".join(_dist_cell(r, k) for k in REPORT_ROUNDS)
            last = _last_round(r)
            last_cell = f"{_dist_cell(r, last)} (r{last})" if last else "-"
            err = "-" if r.error_vs_initial_mean is None else f"{r.error_vs_initial_mean:.2g}"
            if s.kill and r.error_floor is not None:
                err += f" ({r.error_floor:.2g})"
            by = _fmt_bytes(r.bytes_per_peer_round)
            if s.topology == "gossip" and r.logged_bytes_per_peer_round:
                by += f" (logged {_fmt_bytes(r.logged_bytes_per_peer_round)})"
            secs = "-" if r.median_round_s is None else f"{r.median_round_s:.2f} / {r.max_round_s:.1f}"
            gs = _size_summary(r.group_sizes)
            comp = "" if s.compression == "fp16" else f" ({s.compression})"
            out.append(f"| {s.topology}{comp} | {s.peers} | {_kill_cell(r)} | {cells} | {last_cell} | "
                       f"{_fmt_dist(r.full_final_distance)} | {err} | {by} | {secs} | {gs} | {r.failed_rounds} of "
                       f"{sum(len(v) for v in r.records.values())} | {'-' if r.wall_s is None else f'{r.wall_s:.0f}'} |")
        out += ["",
                "Bytes: the mean over all peer-rounds of what each peer sent (failed rounds count 0). Gossip's round "
                "records count only the exchanges a peer initiated, not what it sent while answering others; the "
                "table adds that back (a responder sends exactly what its initiator receives), the logged figure is in "
                "brackets. Wall s includes starting the N process trees (staggered).", ""]
        if png_rel:
            out += [f"![consensus distance vs round]({png_rel})", ""]
        check = [r for r in avg if r.full_final_distance and r.sketch_final_distance]
        if check:
            worst = max(check, key=lambda r: abs(r.sketch_final_distance / r.full_final_distance - 1))
            out += [f"Sketch check: on the saved final vectors, sketch estimate / full-vector distance is between "
                    f"{min(r.sketch_final_distance / r.full_final_distance for r in check):.3f} and "
                    f"{max(r.sketch_final_distance / r.full_final_distance for r in check):.3f} over the "
                    f"{len(check)} runs with a non-zero distance (worst: {worst.spec.label}).", ""]
    if dl:
        out += [
            "### DiLoCo with each topology", "",
            f"Setup: {args.diloco_peers} real `peerd join` daemons per topology, model `tiny`, seq_len {args.seq_len}, "
            f"batch {args.batch_size}, H = {args.H}, {args.diloco_rounds} outer rounds = "
            f"{args.H * args.diloco_rounds * args.batch_size * args.seq_len * args.diloco_peers:,} training tokens in "
            f"all, AdamW lr {args.inner_lr:g} with {args.warmup_steps} warm-up steps, outer SGD Nesterov as in "
            f"bench_diloco, fp16 on the wire, eval on the first {args.eval_batches * args.batch_size} held-out "
            f"windows. allreduce averages pseudo-gradients among all 4 (min_group_size 4; theta_outer bit-identical); "
            f"moshpit (M = 2, grid 2x2, min_group_size 2) and gossip (k = 2 partners) apply their own outer step "
            f"and then average theta_outer and the momentum (2x the values per exchange), so peers stay close, not "
            f"identical.", "",
            "| topology | final eval nats/byte (mean over peers) | min .. max over peers | bytes sent per peer | "
            "outer rounds logged per peer | round_failed events | wall s |",
            "|---|---|---|---|---|---|---|"]
        for r in dl:
            final = "failed" if r.final is None else f"{r.final:.4f}"
            spread = f"{min(r.final_evals):.4f} .. {max(r.final_evals):.4f}" if r.final_evals else "-"
            by = _fmt_bytes(r.bytes_per_peer)
            if r.topology == "gossip" and r.logged_bytes_per_peer:
                by += f" (logged {_fmt_bytes(r.logged_bytes_per_peer)})"
            out.append(f"| {r.topology} | {final} | {spread} | {by} | {r.rounds_logged} | {r.rounds_failed} | "
                       f"{'-' if r.wall_s is None else f'{r.wall_s:.0f}'} |")
        out.append("")
        if png2_rel:
            out += [f"![DiLoCo eval loss vs tokens per topology]({png2_rel})", ""]
    out += [_reading(avg, dl), ""]
    notes = [(r.spec.label, n) for r in avg for n in r.notes] + [(f"DiLoCo {r.topology}", n) for r in dl
                                                                  for n in r.notes]
    if notes:
        out.append("Run notes:")
        out += [f"- {label}: {n}" for label, n in notes]
        out.append("")
    return "\n".join(out)


def _grid(n: int, m: int) -> str:
    g = Grid.for_peers(n, m)
    return "x".join([str(g.side)] * g.dims)


def _size_summary(sizes: list[int]) -> str:
    if not sizes:
        return "-"
    counts: dict[int, int] = {}
    for s in sizes:
        counts[s] = counts.get(s, 0) + 1
    if len(counts) == 1:
        return str(sizes[0])
    return ", ".join(f"{k}: {v}x" for k, v in sorted(counts.items()))


def _rounds_to(r: AvgResult, target: float) -> Optional[int]:
    return next((k for k in sorted(r.distance) if k > 0 and r.distance[k] <= target), None)


def _reading(avg: list[AvgResult], dl: list[DilocoResult]) -> str:
    """A plain reading generated from the numbers: convergence, bytes, what a kill costs, misbehaviour."""
    parts = ["Reading."]
    target = 1e-3
    main = [r for r in avg if r.spec.compression == "fp16" or len({a.spec.compression for a in avg}) == 1]
    for n in sorted({r.spec.peers for r in main}):
        text = []
        for r in (x for x in main if x.spec.peers == n and not x.spec.kill):
            k = _rounds_to(r, target)
            reach = f"below {target:g} after round {k}" if k else f"not below {target:g} in {max(r.distance)} rounds"
            if r.distance.get(k) == 0:
                reach = f"exact (0) after round {k}"
            text.append(f"{r.spec.topology} {reach} ({_fmt_bytes(r.bytes_per_peer_round)} sent per peer per round)")
            if r.spec.topology == "gossip":
                ks = sorted(k for k in r.distance if k > 0 and r.distance[k] > 0)
                if len(ks) >= 2:
                    factor = (r.distance[ks[-1]] / r.distance[ks[0]]) ** (1 / (ks[-1] - ks[0]))
                    text[-1] += f", shrinking ~{1 / factor:.1f}x per round"
        if text:
            parts.append(f"Undisturbed, N={n}: " + "; ".join(text) + ".")
    for r in (x for x in main if x.spec.kill):
        bits = []
        base = next((x for x in main if x.spec.peers == r.spec.peers and x.spec.topology == r.spec.topology
                     and not x.spec.kill), None)
        if r.max_round_s is not None:
            stall = sum(1 for recs in r.records.values() for rec in recs if float(rec.get("seconds", 0)) > 10)
            if stall:
                bits.append(f"{stall} peer-rounds took > 10 s (max {r.max_round_s:.0f} s: waiting out matchmaking "
                            f"for a peer that was dead or in another group)")
        lone = sum(1 for g in r.group_sizes if g == 1) if r.spec.topology != "gossip" else 0
        if lone:
            bits.append(f"{lone} peer-rounds averaged with nobody (group of 1)")
        if r.spec.topology == "moshpit" and r.group_sizes and max(r.group_sizes) >= r.spec.peers - 1:
            bits.append(f"groups of {max(r.group_sizes)} after the kill: the grid for {r.spec.peers - 1} peers "
                        f"(M={r.spec.group_size}) is {_grid(r.spec.peers - 1, r.spec.group_size)}, i.e. moshpit "
                        f"turned into one all-reduce")
        last = _last_round(r)
        if last is not None:
            bits.append(f"distance {_dist_cell(r, last)} at round {last}, {_fmt_dist(r.full_final_distance)} on the "
                        f"final full vectors")
        if r.error_vs_initial_mean is not None:
            ref = f" vs {base.error_vs_initial_mean:.2g} undisturbed" if base and base.error_vs_initial_mean else ""
            bits.append(f"survivors' mean off the all-peer initial mean by {r.error_vs_initial_mean:.2g}{ref} "
                        f"({r.error_floor:.2g} had the victim never existed)")
        if base and base.wall_s and r.wall_s:
            bits.append(f"wall {r.wall_s:.0f} s vs {base.wall_s:.0f} s")
        parts.append(f"Kill, {r.spec.topology} N={r.spec.peers}: " + "; ".join(bits) + ".")
    nonatomic = [(r, n) for r in avg for n in r.notes if "non-atomic" in n]
    if nonatomic:
        parts.append("Misbehaviour: " + "; ".join(f"{r.spec.label}, {n.split(':')[0]}" for r, n in nonatomic) +
                     ": one member's all-reduce failed (the reducer's answer stream ended early) while every other "
                     "member completed the same group, so the failed peer kept its own vector and the swarm's mean "
                     "moved; this, not the kill, is the error vs initial mean of those rows.")
    gossip_fail = [r for r in avg if r.spec.topology == "gossip"]
    failed = sum(int(rec.get("failed") or 0) for r in gossip_fail for recs in r.records.values() for rec in recs)
    busy = sum(int(rec.get("busy") or 0) for r in gossip_fail for recs in r.records.values() for rec in recs)
    if failed and not busy:
        parts.append(f"Misbehaviour: gossip logged {failed} failed exchanges and 0 'busy' answers over all runs: a "
                     f"busy responder answers without reading the initiator's vector and closes the stream, which "
                     f"reaches the initiator as a reset, so busy is counted as failed and peers with large PeerIDs "
                     f"(refused most often) starve.")
    for r in dl:
        if r.initial_eval is None:
            continue
        spikes = [(i, rnd, ev) for i, evs in enumerate(r.peer_evals) for rnd, ev in evs if ev > r.initial_eval]
        if spikes:
            i, rnd, ev = max(spikes, key=lambda x: x[2])
            parts.append(f"Misbehaviour: DiLoCo {r.topology}: {len(spikes)} peer-rounds evaluated worse than the "
                         f"untrained model ({r.initial_eval:.2f}); worst peer {i} after outer round {rnd}: {ev:.2f}.")
    if dl and all(r.final is not None for r in dl):
        ref = next((r for r in dl if r.topology == "allreduce"), dl[0])
        parts.append("DiLoCo, final eval vs allreduce: " + ", ".join(
            f"{r.topology} {r.final / ref.final - 1:+.1%} with {r.bytes_per_peer / ref.bytes_per_peer:.1f}x the bytes"
            for r in dl if r is not ref) + " (moshpit and gossip average theta and momentum, 2P values, where "
            "allreduce averages the P-value pseudo-gradient).")
    return " ".join(parts)


def make_plots(avg: list[AvgResult], dl: list[DilocoResult], png: Optional[str], png2: Optional[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"allreduce": "tab:blue", "moshpit": "tab:orange", "gossip": "tab:green"}
    if png and avg:
        fig, ax = plt.subplots(figsize=(8.5, 5))
        for r in avg:
            xs = sorted(k for k in r.distance if r.live_count.get(k, 0) >= 2)
            ys = [max(r.distance[x], PLOT_FLOOR) for x in xs]
            style = ("-" if r.spec.peers >= 16 else "--") if not r.spec.kill else ":"
            marker = {8: "o", 16: "s"}.get(r.spec.peers, "^")
            ax.plot(xs, ys, style, marker=marker, markersize=3.5, color=colors[r.spec.topology],
                    alpha=0.6 if r.spec.compression != "fp16" else 1.0, label=r.spec.label)
        ax.axhline(PLOT_FLOOR, color="gray", lw=0.5)
        ax.text(0.1, PLOT_FLOOR * 1.6, "exact consensus (0) drawn here", fontsize=7, color="gray")
        ax.set_yscale("log")
        ax.set_xlabel("round")
        ax.set_ylabel("consensus distance (4096-coordinate sketch estimate)")
        ax.set_title("Consensus distance vs round (random 1-per-peer vectors)")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        plt.close(fig)
    if png2 and dl:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for r in dl:
            if r.curve:
                xs, ys = zip(*r.curve)
                ax.plot([x / 1e6 for x in xs], ys, "-", marker="o", markersize=3, color=colors[r.topology],
                        label=r.topology)
        ax.set_xlabel("training tokens, all peers together (millions of bytes)")
        ax.set_ylabel("eval loss (nats/byte, mean over peers)")
        ax.set_title("DiLoCo, 4 peerd daemons, tiny model: averaging topology")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(png2, dpi=120)
        plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Consensus speed, bytes and fault behaviour of the averaging topologies (allreduce, moshpit, "
                    "gossip) among real peers on 127.0.0.1, plus DiLoCo eval loss per topology; writes a section of "
                    "docs/benchmarks.md and two plots.",
        formatter_class=_HelpFormatter,
        epilog="examples: full run (~15-20 min on 2 cores): %(prog)s | smoke run: %(prog)s --quick | "
               "consensus only: %(prog)s --parts consensus")
    p.add_argument("--parts", default="consensus,diloco", help="comma-separated subset of consensus,diloco")
    p.add_argument("--topologies", default=",".join(TOPOLOGIES), help="comma-separated subset of " +
                   ",".join(TOPOLOGIES))
    p.add_argument("--peers", type=int, nargs="+", default=None, help="swarm sizes N (default: 8 16; 4 with --quick)")
    p.add_argument("--numel", type=int, default=None,
                   help="floats per peer vector (default: 1,000,000; 100,000 with --quick)")
    p.add_argument("--compression", default="fp16", choices=("none", "fp16", "int8"), help="codec of the main rows")
    p.add_argument("--uncompressed-rows", action="store_true",
                   help="also run every topology at the smallest N, no kill, with compression none")
    p.add_argument("--rounds", type=int, default=8, help="allreduce / moshpit rounds")
    p.add_argument("--gossip-rounds", type=int, default=12, help="gossip rounds")
    p.add_argument("--no-kill", action="store_true", help="skip the runs with a peer killed mid-run")
    p.add_argument("--group-size-8", type=int, default=2, help="moshpit M for N < 16 (2: a 2x2x2 grid for N=8)")
    p.add_argument("--group-size-16", type=int, default=4, help="moshpit M for N >= 16 (4: a 4x4 grid for N=16)")
    p.add_argument("--partners", type=int, default=2, help="gossip partners per round k")
    p.add_argument("--timeout-s", type=float, default=30.0, help="avgpeer --timeout-s (all-reduce / exchange)")
    p.add_argument("--matchmaking-timeout-s", type=float, default=20.0, help="avgpeer --matchmaking-timeout-s")
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="avgpeer --start-timeout-s")
    p.add_argument("--member-ttl-s", type=float, default=8.0, help="avgpeer --member-ttl-s")
    p.add_argument("--linger-s", type=float, default=30.0, help="avgpeer --linger-s (gossip)")
    p.add_argument("--stagger-s", type=float, default=0.3, help="pause between starting two peers")
    p.add_argument("--run-timeout-s", type=float, default=420.0, help="give up on one swarm run after this")
    p.add_argument("--bootstrap-timeout-s", type=float, default=60.0, help="wait this long for the bootstrap address")
    p.add_argument("--diloco-peers", type=int, default=4, help="DiLoCo daemons per topology")
    p.add_argument("--H", type=int, default=10, help="DiLoCo inner steps")
    p.add_argument("--diloco-rounds", type=int, default=None, help="DiLoCo outer rounds (default: 10; 5 with --quick)")
    p.add_argument("--seq-len", type=int, default=128, help="DiLoCo window length in bytes")
    p.add_argument("--batch-size", type=int, default=8, help="DiLoCo per-peer batch")
    p.add_argument("--inner-lr", type=float, default=4e-4, help="DiLoCo inner peak lr")
    p.add_argument("--warmup-steps", type=int, default=50, help="DiLoCo linear warm-up steps")
    p.add_argument("--eval-batches", type=int, default=None, help="DiLoCo eval batches (default: 16; 4 with --quick)")
    p.add_argument("--diloco-matchmaking-timeout-s", type=float, default=60.0, help="averaging.matchmaking_timeout_s")
    p.add_argument("--peerd", default=os.path.join(os.path.dirname(sys.executable), "peerd"), help="peerd executable")
    p.add_argument("--md", default=None,
                   help="markdown file whose section to replace (default: docs/benchmarks.md; none with --quick)")
    p.add_argument("--png", default=None,
                   help="consensus plot (default: docs/bench_averaging.png; none with --quick)")
    p.add_argument("--png-diloco", default=None,
                   help="DiLoCo eval plot (default: docs/bench_averaging_diloco.png; none with --quick)")
    p.add_argument("--keep-logs", default=None, metavar="DIR",
                   help="keep peer logs in DIR (default: a temp dir, removed unless a run failed)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: N=4, 100k floats, 5 DiLoCo rounds; writes no files unless --md/--png given")
    args = p.parse_args(argv)
    args.peers = args.peers or ([4] if args.quick else [8, 16])
    args.numel = args.numel or (100_000 if args.quick else 1_000_000)
    args.diloco_rounds = args.diloco_rounds or (5 if args.quick else 10)
    args.eval_batches = args.eval_batches or (4 if args.quick else 16)
    if not args.quick:
        args.md = args.md or os.path.join(REPO, "docs", "benchmarks.md")
        args.png = args.png or os.path.join(REPO, "docs", "bench_averaging.png")
        args.png_diloco = args.png_diloco or os.path.join(REPO, "docs", "bench_averaging_diloco.png")
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    args.topologies = [x.strip() for x in args.topologies.split(",") if x.strip()]
    for x in args.parts:
        if x not in ("consensus", "diloco"):
            p.error(f"unknown part {x!r}")
    for x in args.topologies:
        if x not in TOPOLOGIES:
            p.error(f"unknown topology {x!r}")
    if any(n < 3 for n in args.peers):
        p.error("--peers: need N >= 3 (one is killed and averaging needs two)")
    return args


def plan_avg(args: argparse.Namespace) -> list[AvgSpec]:
    specs = []
    for n in args.peers:
        for kill in (False,) if args.no_kill else (False, True):
            for topo in args.topologies:
                specs.append(AvgSpec(topo, n, kill, args.compression,
                                     args.gossip_rounds if topo == "gossip" else args.rounds,
                                     args.group_size_16 if n >= 16 else args.group_size_8, args.partners))
    if args.uncompressed_rows and args.compression != "none":
        n = min(args.peers)
        for topo in args.topologies:
            specs.append(AvgSpec(topo, n, False, "none", args.gossip_rounds if topo == "gossip" else args.rounds,
                                 args.group_size_16 if n >= 16 else args.group_size_8, args.partners))
    return specs


def _check_memory(args: argparse.Namespace) -> None:
    need_gb = 0.7 * max(args.peers) + 1
    have_gb = psutil.virtual_memory().available / 1e9
    print(f"memory: {have_gb:.1f} GB available, ~{need_gb:.1f} GB needed for {max(args.peers)} peers", flush=True)
    if have_gb < need_gb:
        raise SystemExit(f"not enough memory for {max(args.peers)} peers ({have_gb:.1f} GB available, "
                         f"~{need_gb:.1f} GB needed); lower --peers")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in
                       [os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO) else "python",
                        os.path.relpath(os.path.abspath(sys.argv[0]), REPO)] + (argv or sys.argv[1:]))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks that kill the children
    torch.set_num_threads(1)
    workdir = args.keep_logs or tempfile.mkdtemp(prefix="bench_averaging_")
    os.makedirs(workdir, exist_ok=True)
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    global LOAD_AT_START
    LOAD_AT_START = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    t_all = time.perf_counter()
    avg: list[AvgResult] = []
    dl: list[DilocoResult] = []
    if "consensus" in args.parts:
        _check_memory(args)
        for spec in plan_avg(args):
            print(f"== {spec.label}: {spec.rounds} rounds, {args.numel:,} floats", flush=True)
            r = run_avg(spec, args, workdir)
            avg.append(r)
            dists = " ".join(f"r{k}={_fmt_dist(v)}" for k, v in sorted(r.distance.items()))
            print(f"   -> {dists}; {_fmt_bytes(r.bytes_per_peer_round)}/peer/round; "
                  f"{'-' if r.wall_s is None else f'{r.wall_s:.0f}'} s", flush=True)
            for n in r.notes:
                print(f"      note: {n}", flush=True)
    if "diloco" in args.parts:
        for topo in args.topologies:
            print(f"== DiLoCo {topo}: {args.diloco_peers} daemons, H={args.H}, {args.diloco_rounds} rounds", flush=True)
            r = run_diloco(topo, args, workdir)
            dl.append(r)
            final = "failed" if r.final is None else f"{r.final:.4f} nats/byte"
            print(f"   -> {final}, {_fmt_bytes(r.bytes_per_peer)} sent per peer, "
                  f"{'-' if r.wall_s is None else f'{r.wall_s:.0f}'} s", flush=True)
            for n in r.notes:
                print(f"      note: {n}", flush=True)
    total = time.perf_counter() - t_all
    make_plots(avg, dl, args.png, args.png_diloco)
    base = os.path.dirname(os.path.abspath(args.md)) if args.md else os.getcwd()
    png_rel = os.path.relpath(args.png, base) if args.png and avg else None
    png2_rel = os.path.relpath(args.png_diloco, base) if args.png_diloco and dl else None
    section = make_markdown(avg, dl, args, command, date, total, png_rel, png2_rel)
    print()
    print(section)
    if args.md:
        replace_section(args.md, SECTION_HEADING, section)
        print(f"\nwrote {args.md}" + "".join(f" and {x}" for x in (args.png, args.png_diloco) if x))
    all_ok = all(r.ok for r in avg) and all(r.ok for r in dl)
    if not args.keep_logs and all_ok:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not args.keep_logs:
        print(f"logs kept in {workdir}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
