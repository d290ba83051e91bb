#!/usr/bin/env python
"""Benchmark: DiLoCo (real peerd daemons) vs plain AdamW vs gradient all-reduce data parallelism.

All methods train the same model from the same initial weights on the same Shakespeare training text, with the same
total number of training tokens, and are evaluated on the same held-out windows (the first ``eval_batches *
batch_size`` windows of the held-out plays, exactly what the daemons evaluate):

  (a) AdamW: one process, batch = peers x per-peer batch, so each step sees as many tokens as all peers together;
  (b) DiLoCo: ``peers`` real ``peerd join`` daemons plus one ``peerd bootstrap`` node on 127.0.0.1, for each H;
  (c) data parallel: ``peers`` processes (torch.multiprocessing spawn) all-reducing gradients every step over gloo.

(a) and (c) use DiLoCo's inner optimizer (``protocols.diloco.make_inner_optimizer``: AdamW lr, betas, weight decay)
with the same warm-up schedule (``inner_lr_at``) and gradient clipping. Every process uses one torch thread.

Results replace the section ``SECTION_HEADING`` of docs/benchmarks.md (other sections are kept) and the eval curves
go to docs/bench_diloco.png. ``--quick`` is a smoke run that writes no files unless --md/--png are given.

Everything listens on 127.0.0.1 only: hivemind peers get ``/ip4/127.0.0.1/tcp/0``; the gloo rendezvous store is
served by this process from a socket bound to 127.0.0.1, and gloo itself binds to the loopback interface.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from peerd.testing.localswarm import ProcessSet, pump_lines  # noqa: E402
from peerd.run_config import load_run_config  # noqa: E402
from peerd.data.corpus import evaluate, load_corpus, WindowSampler  # noqa: E402
from peerd.models import build_model, count_parameters  # noqa: E402
from protocols.diloco import DiLoCoHyperparams, inner_lr_at, make_inner_optimizer, set_lr  # noqa: E402

from benchlib import replace_section  # noqa: E402

SECTION_HEADING = "## DiLoCo vs AdamW vs data-parallel (scripts/bench_diloco.py)"
LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"
FEW_PERCENT = 0.05
"""'Within a few percent' of the baseline loss, as the reading of the table judges it."""


@dataclass(frozen=True)
class Settings:
    """What every method shares; plain values so spawn can pickle it."""

    model: str
    seq_len: int
    batch_size: int
    """Per-peer batch (sequences per step of one DiLoCo or data-parallel peer)."""
    peers: int
    steps: int
    """Training steps per peer; the AdamW baseline takes as many steps with a batch ``peers`` times larger."""
    eval_batches: int
    eval_every: int
    """Steps between two evaluations of the baseline and data-parallel runs."""
    seed: int
    hp: DiLoCoHyperparams

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one step of all peers together (= one baseline step)."""
        return self.peers * self.batch_size * self.seq_len


@dataclass
class RunResult:
    label: str
    h: int | None
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(training tokens of all peers together, eval nats/byte)."""
    bytes_per_peer: float | None = None
    bytes_received_per_peer: float | None = None
    """DiLoCo only: mean of the daemons' ``bytes_received``; in a closed group it must equal the sent mean."""
    wall_s: float | None = None
    ok: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def final(self) -> float | None:
        return self.curve[-1][1] if self.ok and self.curve else None


# ---------------------------------------------------------------------------------------------------------------
# (a) and (c): AdamW in one process or all-reduced across spawned processes


def _train_worker(rank: int, s: Settings, world: int, batch_size: int, store_port: int | None, out_path: str) -> None:
    """One training process: ``world == 1`` is the baseline; else rank ``rank`` of gloo data parallelism."""
    torch.set_num_threads(1)
    if world > 1:
        store = dist.TCPStore("127.0.0.1", store_port, world, False, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    corpus = load_corpus("shakespeare")
    model = build_model(s.model, s.seq_len, s.seed)
    opt = make_inner_optimizer(model.parameters(), s.hp)
    sampler = WindowSampler(corpus.train, s.seq_len, batch_size, seed=f"bench/{s.seed}/{world}/{rank}")
    params = list(model.parameters())

    def eval_nats() -> float:
        return evaluate(model, corpus.eval, s.seq_len, s.batch_size, s.eval_batches).nats_per_byte

    curve = [(0, eval_nats())] if rank == 0 else []
    t0 = time.perf_counter()
    for step in range(s.steps):
        x, y = sampler.next_batch()  # (B, T), (B, T)
        set_lr(opt, inner_lr_at(step, s.hp))
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        if world > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # (P,) one message per step
            dist.all_reduce(flat)
            flat.div_(world)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        if s.hp.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, s.hp.grad_clip_norm)
        opt.step()
        done = step + 1
        if rank == 0 and (done % s.eval_every == 0 or done == s.steps):
            curve.append((done * s.tokens_per_step, eval_nats()))
    train_s = time.perf_counter() - t0
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"curve": curve, "train_s": train_s, "params": count_parameters(model)}, f)


def run_local(s: Settings, data_parallel: bool, workdir: str) -> RunResult:
    """Baseline (one process, batch peers x B) or gloo data parallelism (peers processes, batch B each)."""
    world = s.peers if data_parallel else 1
    label = f"data-parallel AdamW, gloo all-reduce ({world} procs)" if data_parallel else "AdamW (1 process)"
    result = RunResult(label, 1 if data_parallel else None)
    out_path = os.path.join(workdir, f"{'dp' if data_parallel else 'baseline'}.json")
    store = None
    saved_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
    try:
        if data_parallel:
            # torch's TCPStore server binds the wildcard address; serve it here from a socket bound to loopback.
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
                listener.bind(("127.0.0.1", 0))
                listener.listen(128)
                port = listener.getsockname()[1]
                store = dist.TCPStore("127.0.0.1", port, world, True, timeout=datetime.timedelta(seconds=120),
                                      wait_for_workers=False, master_listen_fd=os.dup(listener.fileno()))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        else:
            port = None
        t0 = time.perf_counter()
        mp.spawn(_train_worker, args=(s, world, s.batch_size * (1 if data_parallel else s.peers), port, out_path),
                 nprocs=world, join=True)
        result.wall_s = time.perf_counter() - t0
        with open(out_path) as f:
            out = json.load(f)
        result.curve = [(int(t), float(v)) for t, v in out["curve"]]
        params = out["params"]
        result.notes.append(f"training loop {out['train_s']:.0f} s of the wall time (the rest: process start-up)")
        if data_parallel:
            # Analytic: a ring all-reduce sends 2(N-1)/N of the fp32 gradient per peer per step.
            result.bytes_per_peer = 2 * (world - 1) / world * 4 * params * s.steps
            result.notes.append("bytes computed analytically (ring all-reduce, 2(N-1)/N x 4 B x P per step)")
        else:
            result.bytes_per_peer = 0.0
        result.ok = True
    except Exception as e:  # noqa: BLE001 - a failed method is reported, the others still run
        result.notes.append(f"failed: {type(e).__name__}: {e}")
    finally:
        del store  # closes its listening socket
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return result


# ---------------------------------------------------------------------------------------------------------------
# (b): DiLoCo with real peerd daemons


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


#: ``--variants`` keys: the ``[diloco]`` ones, and the ``[averaging.allreduce]`` codecs and exchange.
VARIANT_KEYS = {"overlap": "diloco", "fragments": "diloco", "outer_lr": "diloco", "compression": "allreduce",
                "result_compression": "allreduce", "exchange": "allreduce"}


def parse_variant(text: str) -> dict:
    """``"overlap=delayed,fragments=4,compression=fp4"`` -> {key: value}; "fp16" (or "") is today's DiLoCo.
    Raises ValueError naming an unknown key."""
    out: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item == "fp16":
            continue
        key, sep, value = item.partition("=")
        if not sep or key not in VARIANT_KEYS:
            raise ValueError(f"variant item {item!r}: expected one of {', '.join(VARIANT_KEYS)} = value")
        out[key] = int(value) if key == "fragments" else float(value) if key == "outer_lr" else value
    return out


def write_run_config(path: str, s: Settings, h: int, rounds: int, matchmaking_timeout_s: float,
                     variant: dict | None = None) -> None:
    variant = variant or {}
    top = dict(model=s.model, seq_len=s.seq_len, batch_size=s.batch_size, dataset="shakespeare", seed=s.seed,
               max_outer_rounds=rounds, eval_batches=s.eval_batches)
    diloco = {**s.hp.to_dict(), "inner_steps": h, **{k: v for k, v in variant.items() if VARIANT_KEYS[k] == "diloco"}}
    codecs = {k: v for k, v in variant.items() if VARIANT_KEYS[k] == "allreduce"}
    tables = [("diloco", diloco)]
    if set(codecs) <= {"compression"}:  # the flat form every earlier run of this benchmark used
        tables.append(("averaging", dict(method="allreduce", compression=codecs.get("compression", "fp16"),
                                         min_group_size=s.peers, matchmaking_timeout_s=matchmaking_timeout_s,
                                         request_timeout_s=10.0, sender_timeout_s=30.0, reducer_timeout_s=60.0)))
    else:  # result_compression and exchange have no flat key: the same settings as sub-tables
        tables += [("averaging", dict(method="allreduce")),
                   ("averaging.matchmaking", dict(min_group_size=s.peers, matchmaking_timeout_s=matchmaking_timeout_s,
                                                  request_timeout_s=10.0,
                                                  poll_interval_s=min(0.5, matchmaking_timeout_s / 4))),
                   ("averaging.allreduce", dict(compression=codecs.get("compression", "fp16"),
                                                **{k: v for k, v in codecs.items() if k != "compression"},
                                                sender_timeout_s=30.0, reducer_timeout_s=60.0))]
    lines = [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    for name, table in tables:
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    load_run_config(path)  # the daemon's own schema check, before any process starts


def run_diloco(s: Settings, h: int, args: argparse.Namespace, workdir: str, variant: str = "fp16") -> RunResult:
    """``s.peers`` peerd daemons on one run until ``max_outer_rounds``; everything read from their JSON logs.
    ``variant``: a ``--variants`` item (overlap, fragments, codecs)."""
    rounds = s.steps // h
    label = f"DiLoCo, {s.peers} peerd daemons" + ("" if variant == "fp16" else f", {variant}")
    result = RunResult(label, h)
    rundir = os.path.join(workdir, f"diloco-h{h}-" + "".join(c if c.isalnum() else "_" for c in variant))
    os.makedirs(rundir)
    config_path = os.path.join(rundir, "run.toml")
    write_run_config(config_path, s, h, rounds, args.matchmaking_timeout_s, parse_variant(variant))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PEERD_THREADS="1")
    peerd = args.peerd
    children = ProcessSet()
    events: list[list[dict]] = [[] for _ in range(s.peers)]
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
            print(f"  [H={h}] round {rec.get('outer_round')}/{rounds} group={rec.get('group_size')} "
                  f"eval={rec.get('eval_nats_per_byte')}", flush=True)

    t0 = None
    try:
        boot = children.start(
            [peerd, "bootstrap", "--host-maddrs", LOOPBACK_MADDR, "--identity", os.path.join(rundir, "boot.key")],
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
        for i in range(s.peers):
            p = children.start(
                [peerd, "join", "--run-id", f"bench-diloco-h{h}-{os.getpid()}", "--run-config", config_path,
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
                time.sleep(5)  # let the others notice and log before they are stopped
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
        _summarize_diloco(result, events, s, h, rounds)
    if not result.ok:
        result.notes.append(f"logs kept in {rundir}")
    return result


def _summarize_diloco(result: RunResult, events: list[list[dict]], s: Settings, h: int, rounds: int) -> None:
    notes = result.notes
    by_round: dict[int, list[dict]] = {}
    for i, evs in enumerate(events):
        done = [e for e in evs if e.get("event") == "outer_round"]
        if len(done) != rounds:
            notes.append(f"peer {i} logged {len(done)} outer_round events, expected {rounds}")
        small = [e.get("outer_round") for e in done if (e.get("group_size") or 0) < s.peers]
        if small:
            notes.append(f"peer {i}: rounds {small} had group_size < {s.peers}")
        for e in done:
            by_round.setdefault(int(e["outer_round"]), []).append(e)
    initial = [e.get("eval_nats_per_byte") for evs in events for e in evs
               if e.get("event") == "eval" and e.get("outer_round") == 0]
    if not initial:
        notes.append("no initial eval event (outer_round 0)")
    else:
        result.curve.append((0, float(initial[0])))
        if max(initial) - min(initial) > 1e-6:
            notes.append(f"initial evals differ between peers: {initial}")
    per_peer_bytes = [sum(int(e.get("bytes_sent") or 0) for e in evs if e.get("event") == "outer_round")
                      for evs in events]
    result.bytes_per_peer = sum(per_peer_bytes) / len(per_peer_bytes)
    per_peer_received = [sum(int(e.get("bytes_received") or 0) for e in evs if e.get("event") == "outer_round")
                         for evs in events]
    result.bytes_received_per_peer = sum(per_peer_received) / len(per_peer_received)
    if abs(sum(per_peer_bytes) - sum(per_peer_received)) > 0.01 * max(sum(per_peer_received), 1):
        notes.append(f"logged bytes_sent total {_fmt_bytes(sum(per_peer_bytes))} but bytes_received total "
                     f"{_fmt_bytes(sum(per_peer_received))} over all peers; within one group these must match")
    if per_peer_bytes and max(per_peer_bytes) > 1.2 * min(per_peer_bytes):
        notes.append(f"bytes_sent per peer uneven: {per_peer_bytes}")
    expected_tokens = h * s.batch_size * s.seq_len
    for r in sorted(by_round):
        recs = by_round[r]
        if len({e.get("digest") for e in recs}) > 1:
            notes.append(f"round {r}: peers disagree on the outer-state digest")
        evals = [float(e["eval_nats_per_byte"]) for e in recs if e.get("eval_nats_per_byte") is not None]
        if evals and max(evals) - min(evals) > 1e-6:
            notes.append(f"round {r}: eval differs between peers ({min(evals):.6f}..{max(evals):.6f})")
        tokens = sum(int(e.get("tokens") or 0) for e in recs)
        if len(recs) == s.peers and tokens != s.peers * r * expected_tokens:
            notes.append(f"round {r}: peers report {tokens} tokens in all, expected {s.peers * r * expected_tokens}")
        if evals:
            result.curve.append((tokens, sum(evals) / len(evals)))
    allreduce = [float(e["allreduce_s"]) for recs in by_round.values() for e in recs if e.get("allreduce_s")]
    if allreduce:
        notes.append(f"all-reduce {sum(allreduce) / len(allreduce):.2f} s mean per round "
                     f"(max {max(allreduce):.2f})")
    complete = all(len(by_round.get(r, [])) == s.peers for r in range(1, rounds + 1))
    has_final = bool(by_round.get(rounds)) and any(
        e.get("eval_nats_per_byte") is not None for e in by_round[rounds])
    result.ok = complete and has_final and not any(n.startswith(("failed", "timed out", "peer(s)")) for n in notes)
    if not complete and by_round and sorted(by_round)[0] != 1:
        notes.append(f"outer_round numbering starts at {sorted(by_round)[0]}, expected 1..{rounds}")


# ---------------------------------------------------------------------------------------------------------------
# Report


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        nproc = str(os.cpu_count())
    return f"`nproc` = {nproc}, {model}, {platform.system()} {platform.machine()}, torch {torch.__version__}"


def make_markdown(results: list[RunResult], s: Settings, command: str, date: str, total_wall_s: float,
                  png_rel: str | None, params: int) -> str:
    base = next((r for r in results if r.h is None and r.ok), None)
    dp = next((r for r in results if r.h == 1 and r.ok), None)
    tokens = s.steps * s.tokens_per_step
    out = [SECTION_HEADING, "",
           f"Command: `{command}`  ",
           f"Date: {date}  ",
           f"Machine: {_machine()}  ",
           f"Whole benchmark: {total_wall_s:.0f} s wall.", "",
           f"Setup: model `{s.model}` ({params:,} parameters), seq_len {s.seq_len}, {s.peers} peers x batch "
           f"{s.batch_size} (baseline: one process, batch {s.peers * s.batch_size}), {s.steps} steps per peer = "
           f"{tokens:,} training tokens (bytes) per method, Shakespeare with the held-out plays as eval "
           f"(first {s.eval_batches * s.batch_size} windows of {s.seq_len} bytes, identical for every row). Inner / "
           f"baseline optimizer: AdamW lr {s.hp.inner_lr:g}, betas {s.hp.inner_betas}, weight decay "
           f"{s.hp.inner_weight_decay:g}, {s.hp.warmup_steps} warm-up steps, grad clip {s.hp.grad_clip_norm:g}. "
           f"DiLoCo outer: SGD lr {s.hp.outer_lr:g}, Nesterov momentum {s.hp.outer_momentum:g}; fp16 pseudo-gradients, "
           f"min_group_size {s.peers}. One torch thread per process; the {s.peers}-process runs share "
           f"{os.cpu_count()} cores, so wall times compare poorly across rows.", "",
           "| method | H | eval nats/byte | bits/byte | ratio to baseline | bytes sent per peer | "
           "comm reduction vs DP | wall s |",
           "|---|---|---|---|---|---|---|---|"]
    for r in results:
        h = "-" if r.h is None else str(r.h)
        if r.final is None:
            out.append(f"| {r.label} | {h} | failed | - | - | {_fmt_bytes(r.bytes_per_peer)} | - | "
                       f"{'-' if r.wall_s is None else f'{r.wall_s:.0f}'} |")
            continue
        ratio = f"{r.final / base.final:.3f}" if base else "-"
        if dp and r.bytes_per_peer:
            reduction = f"{dp.bytes_per_peer / r.bytes_per_peer:.1f}x"
        else:
            reduction = "-"
        bytes_s = _fmt_bytes(r.bytes_per_peer) + (" (analytic)" if r.h == 1 else "")
        out.append(f"| {r.label} | {h} | {r.final:.4f} | {r.final / math.log(2):.4f} | {ratio} | {bytes_s} | "
                   f"{reduction} | {r.wall_s:.0f} |")
    out.append("")
    out.append("Bytes: data parallel is the analytic ring all-reduce volume 2(N-1)/N x 4 B x P per step (gloo may "
               "use another algorithm); DiLoCo is the sum of the `bytes_sent` fields of the daemons' `outer_round` "
               "events, averaged over peers.")
    out.append("")
    if png_rel:
        out += [f"![eval loss vs training tokens]({png_rel})", ""]
    out += [_reading(results, base, dp), ""]
    notes = [(r, n) for r in results for n in r.notes]
    if notes:
        out.append("Run notes:")
        out += [f"- {r.label}{'' if r.h in (None, 1) else f' H={r.h}'}: {n}" for r, n in notes]
        out.append("")
    return "\n".join(out)


def _reading(results: list[RunResult], base: RunResult | None, dp: RunResult | None) -> str:
    diloco = [r for r in results if r.h not in (None, 1)]
    if base is None or not diloco:
        return "Reading: not enough successful runs to compare against the paper."
    parts = [f"Reading against the DiLoCo paper (Douillard et al. 2023), whose shape is: DiLoCo ends within a few "
             f"percent of (or below) the synchronous baseline's loss while sending ~H times fewer bytes. Here "
             f"'a few percent' is taken as at most {FEW_PERCENT:.0%}, and the expected byte reduction against data "
             f"parallel is ~2H (one all-reduce every H steps instead of every step, in fp16 instead of fp32)."]
    for r in diloco:
        if r.final is None:
            parts.append(f"H={r.h} did not complete, so it says nothing.")
            continue
        gap = r.final / base.final - 1
        if abs(gap) <= FEW_PERCENT:
            verdict = "within a few percent: agrees"
        elif gap > 0:
            verdict = "more than a few percent worse: does not agree"
        else:
            verdict = "more than a few percent better: agrees (better than the paper's claim)"
        text = f"H={r.h}: loss {gap:+.1%} vs the AdamW baseline ({verdict})"
        if dp and r.bytes_per_peer:
            expected = 2 * r.h
            rec = r.bytes_received_per_peer
            trusted, undercount = r.bytes_per_peer, False
            if rec and abs(rec - r.bytes_per_peer) > 0.05 * rec:
                text += (f"; its logged `bytes_sent` ({_fmt_bytes(r.bytes_per_peer)} per peer, "
                         f"{dp.bytes_per_peer / r.bytes_per_peer:.0f}x less than data parallel) do not match the "
                         f"`bytes_received` the same peers logged ({_fmt_bytes(rec)} per peer; in one group the "
                         f"totals must match), so `bytes_sent` under-counts in this run; by received bytes")
                trusted, undercount = rec, True
            reduction = dp.bytes_per_peer / trusted
            agree = "agrees" if 0.7 * expected <= reduction <= 1.3 * expected else "does not agree"
            text += (f"{'' if undercount else ';'} it sends {reduction:.0f}x fewer bytes than data parallel, "
                     f"vs ~{expected}x expected ({agree})")
        parts.append(text + ".")
    if dp and dp.final is not None:
        parts.append(f"Data parallel ends {dp.final / base.final - 1:+.1%} from the baseline, which should be near 0 "
                     "(same update maths, different samples).")
    parts.append("Caveat: the paper trains models of tens to hundreds of millions of parameters for tens of thousands "
                 "of steps with H up to 500 and 1000 warm-up steps; this is a sub-1M model over a few hundred steps, "
                 "early in training, where each outer step is a large share of all training.")
    return " ".join(parts)


def make_plot(results: list[RunResult], path: str, s: Settings) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in results:
        if not r.curve:
            continue
        xs, ys = zip(*r.curve)
        label = r.label if r.h in (None, 1) else f"{r.label}, H={r.h}"
        style = {None: "-", 1: "--"}.get(r.h, "-.")
        ax.plot([x / 1e6 for x in xs], ys, style, marker="o", markersize=3, label=label)
    ax.set_xlabel("training tokens, all peers together (millions of bytes)")
    ax.set_ylabel("eval loss (nats/byte)")
    ax.set_title(f"{s.model} model, {s.peers} peers x batch {s.batch_size}, seq_len {s.seq_len}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Compare DiLoCo (real peerd daemons on 127.0.0.1) with single-process AdamW and gloo "
                    "data parallelism at equal training tokens; write a section of docs/benchmarks.md and a plot.",
        formatter_class=_HelpFormatter,
        epilog="examples: full run (~10-15 min on 2 cores): %(prog)s | smoke run: %(prog)s --quick | "
               "without daemons: %(prog)s --methods baseline,dp")
    p.add_argument("--model", default="tiny", choices=("tiny", "small"), help="model size")
    p.add_argument("--seq-len", type=int, default=128, help="window length in bytes")
    p.add_argument("--batch-size", type=int, default=8, help="per-peer batch (the baseline uses peers x this)")
    p.add_argument("--peers", type=int, default=4, help="DiLoCo / data-parallel peers")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per peer; every H must divide it (rounds = steps / H) (default: 200, "
                        "100 with --quick)")
    p.add_argument("--H", dest="hs", type=int, nargs="+", default=[10, 50], help="DiLoCo inner steps to run")
    p.add_argument("--variants", nargs="+", default=["fp16"],
                   help="DiLoCo variants to run for each H, each a comma-separated list of key=value with keys "
                        "overlap (none|delayed), fragments (F), outer_lr, compression and result_compression "
                        "(codecs), exchange (reduce|gather: the sparse all-gather of top-k), e.g. "
                        "fp16 'overlap=delayed' 'fragments=4' 'compression=fp4,result_compression=fp4' "
                        "'compression=topk,result_compression=fp4' (default: fp16, today's DiLoCo)")
    p.add_argument("--methods", default="baseline,dp,diloco",
                   help="comma-separated subset of baseline,dp,diloco")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="eval batches of batch-size windows, also the daemons' eval_batches (default: 16, 4 with "
                        "--quick)")
    p.add_argument("--inner-lr", type=float, default=4e-4, help="AdamW / DiLoCo inner peak lr")
    p.add_argument("--warmup-steps", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--seed", type=int, default=0, help="model-init and data seed")
    p.add_argument("--matchmaking-timeout-s", type=float, default=60.0, help="DiLoCo averaging.matchmaking_timeout_s")
    p.add_argument("--run-timeout-s", type=float, default=1200.0, help="give up on one DiLoCo run after this")
    p.add_argument("--bootstrap-timeout-s", type=float, default=60.0, help="wait this long for the bootstrap address")
    p.add_argument("--peerd", default=os.path.join(os.path.dirname(sys.executable), "peerd"),
                   help="peerd executable")
    p.add_argument("--md", default=None,
                   help="markdown file whose section to replace (default: docs/benchmarks.md; none with --quick)")
    p.add_argument("--png", default=None,
                   help="eval-curve plot to write (default: docs/bench_diloco.png; none with --quick)")
    p.add_argument("--keep-logs", default=None, metavar="DIR",
                   help="keep daemon logs and configs in DIR (default: a temp dir, removed unless a run failed)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 100 steps per peer, 4 eval batches, writes no files unless --md/--png given")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 100 if args.quick else 200
    if args.eval_batches is None:
        args.eval_batches = 4 if args.quick else 16
    if not args.quick:
        args.md = args.md or os.path.join(REPO, "docs", "benchmarks.md")
        args.png = args.png or os.path.join(REPO, "docs", "bench_diloco.png")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        if m not in ("baseline", "dp", "diloco"):
            p.error(f"unknown method {m!r}")
    for h in args.hs:
        if h < 1 or args.steps % h:
            p.error(f"H={h} does not divide --steps {args.steps}")
    for variant in args.variants:
        try:
            parsed = parse_variant(variant)
            DiLoCoHyperparams(inner_steps=min(args.hs), **{k: v for k, v in parsed.items()
                                                          if VARIANT_KEYS[k] == "diloco"})
        except ValueError as e:
            p.error(f"--variants {variant!r}: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in
                       [os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO) else "python",
                        os.path.relpath(os.path.abspath(sys.argv[0]), REPO)] + (argv or sys.argv[1:]))
    hp = DiLoCoHyperparams(inner_lr=args.inner_lr, warmup_steps=args.warmup_steps)
    s = Settings(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, peers=args.peers,
                 steps=args.steps, eval_batches=args.eval_batches, eval_every=min(args.hs), seed=args.seed, hp=hp)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks that stop the daemons
    torch.set_num_threads(1)
    params = count_parameters(build_model(s.model, s.seq_len, s.seed))
    workdir = args.keep_logs or tempfile.mkdtemp(prefix="bench_diloco_")
    os.makedirs(workdir, exist_ok=True)
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    results: list[RunResult] = []
    t_all = time.perf_counter()
    plan = ([("baseline", None, "")] if "baseline" in args.methods else []) + \
           ([("dp", None, "")] if "dp" in args.methods else []) + \
           ([("diloco", h, v) for h in args.hs for v in args.variants] if "diloco" in args.methods else [])
    for method, h, variant in plan:
        print(f"== {method}{'' if h is None else f' H={h}'} {variant} ({s.steps} steps per peer)", flush=True)
        if method == "diloco":
            r = run_diloco(s, h, args, workdir, variant)
        else:
            r = run_local(s, method == "dp", workdir)
        results.append(r)
        final = "failed" if r.final is None else f"{r.final:.4f} nats/byte"
        wall = "-" if r.wall_s is None else f"{r.wall_s:.0f} s"
        print(f"   -> {final}, {_fmt_bytes(r.bytes_per_peer)} sent per peer, {wall}", flush=True)
        for n in r.notes:
            print(f"      note: {n}", flush=True)
    total = time.perf_counter() - t_all
    png_rel = None
    if args.png:
        make_plot(results, args.png, s)
        png_rel = os.path.relpath(args.png, os.path.dirname(os.path.abspath(args.md))) if args.md else args.png
    section = make_markdown(results, s, command, date, total, png_rel, params)
    print()
    print(section)
    if args.md:
        replace_section(args.md, SECTION_HEADING, section)
        print(f"\nwrote {args.md}" + (f" and {args.png}" if args.png else ""))
    if not args.keep_logs and all(r.ok for r in results):
        shutil.rmtree(workdir, ignore_errors=True)
    elif not args.keep_logs:
        print(f"logs kept in {workdir}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
