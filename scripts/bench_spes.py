#!/usr/bin/env python
"""Benchmark: SPES vs DiLoCo on the full MoE vs single-process training, on the same MoE model and tokens.

Three parts, side by side in one run:

- Loss (``--loss-model``, CPU-sized by default: tiny-moe): ``--peers`` in-process peers (one asyncio loop, the
  in-process transport ``peerd.transport.inprocess.Hub``, real roles, matchmaking and all-reduce) train
  ``--rounds`` rounds of ``--sync-steps`` inner steps on Shakespeare: SPES with and without the merging warm-up
  (``SpesRole``), DiLoCo on the full MoE (``DiLoCoRole``: every peer trains every expert, Nesterov outer step) and one
  process training the whole model on ``--peers`` times the batch (the same tokens). Reported: eval loss (nats/byte,
  the run's first ``--eval-batches`` eval batches) after the last round; bytes sent per peer per sync round
  (``RoundDone.bytes_sent``: all-reduce plus, for SPES, the expert refreshes served).
- Memory (``--model``): parameters + gradients + AdamW state, measured (bytes of the tensors that exist after one
  training step) for a SPES peer (shared + its experts trained, the rest frozen) and for a peer training every
  parameter; and the peak RSS of a fresh process doing ``RSS_STEPS`` such steps (``ru_maxrss``), with its growth over
  the RSS right after building the model.
- Bytes (``--model``): one sync round among ``--peers`` in-process peers (``SparseSync``, ``--compression``): SPES
  = shared with everyone + each expert among its holders + the refresh of untrained copies; full = every expert
  held by every peer (the bytes of one whole-model all-reduce plus per-fragment headers).

Expert claims come from ``protocols.spes.rebalance`` (fair shares, ``--min-holders``), what the role computes after a
sync. Results replace the section ``SECTION_HEADING`` of docs/benchmarks.md with ``--md``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from peerd.config import NodeConfig  # noqa: E402
from peerd.data.corpus import WindowSampler, evaluate, load_corpus  # noqa: E402
from peerd.models import build_model, build_moe_model  # noqa: E402
from peerd.roles.base import RunContext, role_class  # noqa: E402
from peerd.run_config import AveragingConfig, RunConfig  # noqa: E402
from protocols.diloco import DiLoCoHyperparams, inner_lr_at, make_inner_optimizer, set_lr  # noqa: E402
from peerd.models.local_experts import gradient_bytes, optimizer_state_bytes, train_only_experts  # noqa: E402
from peerd.identity.namespace import RunNamespace, RunRef  # noqa: E402
from peerd.roles.spes_sync import SparseSync  # noqa: E402
from peerd.transport.inprocess import Hub  # noqa: E402
from protocols.allreduce import AllReduceConfig  # noqa: E402
from protocols.matchmaking import MatchmakingConfig  # noqa: E402
from protocols.spes import PeerClaim, SpesConfig, rebalance  # noqa: E402

from benchlib import replace_section  # noqa: E402

SECTION_HEADING = "## SPES vs DiLoCo on the full MoE: memory and bytes per peer (scripts/bench_spes.py)"


def training_state(model_name: str, seq_len: int, experts) -> dict:
    model = build_moe_model(model_name, seq_len, seed=0)
    optimizer = torch.optim.AdamW(train_only_experts(model, experts), lr=1e-3)
    idx = torch.randint(0, 256, (8, seq_len), generator=torch.Generator().manual_seed(0))
    _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads, state = gradient_bytes(model), optimizer_state_bytes(optimizer)
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}


async def sync_bytes(model_name: str, seq_len: int, claims: dict, compression: str) -> dict:
    hub = Hub()
    ns = RunNamespace(run=RunRef.parse("bench-spes"))
    mm = MatchmakingConfig(matchmaking_timeout_s=30.0, request_timeout_s=10.0, poll_interval_s=0.05)
    ar = AllReduceConfig(compression=compression, sender_timeout_s=30.0, reducer_timeout_s=60.0)
    syncs = {}
    for name, own in claims.items():
        s = SparseSync(hub.transport(name), ns, "spes", build_moe_model(model_name, seq_len, seed=0), own, mm, ar,
                       refresh_timeout_s=60.0)
        await s.start()
        syncs[name] = s
    reports = await asyncio.gather(*[s.sync(0, len(syncs), 1.0) for s in syncs.values()])
    for s in syncs.values():
        await s.stop()
    failed = {n: r.failed for n, r in zip(syncs, reports) if r.failed}
    if failed:
        raise RuntimeError(f"sync failed: {failed}")
    n = len(reports)
    return {"allreduce_sent": sum(r.allreduce_bytes_sent for r in reports) / n,
            "refresh_received": sum(r.refresh_bytes_received for r in reports) / n}


#: training steps of the peak-RSS probe process
RSS_STEPS = 3


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _rss_probe(model_name: str, seq_len: int, experts: list[int]) -> dict:
    """Run in a fresh process (``--rss-probe``): peak RSS of RSS_STEPS training steps of a peer training ``experts``.
    ``growth``: the peak during training over the RSS right after building the model (the kernel's peak counter,
    VmHWM, is reset after the build by writing 5 to /proc/self/clear_refs; ``ru_maxrss`` cannot be reset)."""
    import resource

    torch.set_num_threads(1)
    model = build_moe_model(model_name, seq_len, seed=0)
    built = _status_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    optimizer = torch.optim.AdamW(train_only_experts(model, experts), lr=1e-3)
    idx = torch.randint(0, 256, (8, seq_len), generator=torch.Generator().manual_seed(0))
    for _ in range(RSS_STEPS):
        _, loss = model(idx, idx)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    training_peak = _status_kib("VmHWM") * 1024
    return {"peak_rss": peak, "after_build_rss": built, "growth": training_peak - built}


def peak_rss(model_name: str, seq_len: int, experts) -> dict:
    """:func:`_rss_probe` in a fresh interpreter (bytes; Linux ``ru_maxrss`` is in KiB)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-probe", "--model", model_name,
                          "--seq-len", str(seq_len), "--probe-experts", ",".join(map(str, sorted(experts)))],
                         check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _loss_run_config(a, parallelism: str, merge: bool, rounds: int, min_holders: int = 0,
                     plain_outer: bool = False) -> RunConfig:
    """The loss part's run; ``min_holders`` 0 = ``--min-holders``; ``plain_outer``: DiLoCo's outer step as plain
    averaging (outer lr 1, no momentum), SPES's outer step."""
    hp = DiLoCoHyperparams(inner_steps=a.sync_steps, warmup_steps=a.warmup_steps, inner_lr=a.inner_lr)
    if plain_outer:
        hp = dataclasses.replace(hp, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)
    return RunConfig(
        model=a.loss_model, parallelism=parallelism, seq_len=a.seq_len, batch_size=a.batch_size,
        eval_batches=a.eval_batches, max_outer_rounds=rounds,
        diloco=hp,
        spes=SpesConfig(sync_steps=a.sync_steps, min_holders=min_holders or a.min_holders,
                        merge_interval=a.merge_interval if merge else 0,
                        merge_decay_steps=a.sync_steps * rounds, alpha_0=a.alpha_0),
        averaging=AveragingConfig.from_flat(compression=a.compression, matchmaking_timeout_s=30.0,
                                            request_timeout_s=10.0, sender_timeout_s=30.0, reducer_timeout_s=60.0))


async def _train_peers(a, run: RunConfig, checkpoint_dir: str) -> dict:
    """``a.peers`` in-process peers of ``run`` on one Hub until ``max_outer_rounds``; final eval and bytes."""
    hub = Hub()
    roles = []
    for i in range(a.peers):
        node = NodeConfig(checkpoint_dir=os.path.join(checkpoint_dir, f"peer{i}"), threads=1, device="cpu",
                          status_interval_s=0.5, status_ttl_s=30.0, log_every_steps=10 ** 6)
        roles.append(role_class(run.parallelism)(RunContext.build("bench-spes-loss", run, node,
                                                                  hub.transport(f"peer{i}"))))
    done, left = [], []
    for r in roles:
        r.ctx.events.subscribe(lambda e: done.append(e) if e.name == "outer_round" else None)
        r.ctx.events.subscribe(lambda e: left.append(e) if e.name == "leave" else None)
    started = time.perf_counter()
    await asyncio.gather(*[r.run(r.ctx) for r in roles])
    evals = {r.stats.last_eval for r in roles}
    return {"eval_nats_per_byte": max(evals), "eval_spread": max(evals) - min(evals),
            "rounds": sorted({e.outer_round for e in done}),
            "bytes_sent_per_peer_round": sum(e.bytes_sent for e in left) / (a.peers * run.max_outer_rounds),
            "seconds": round(time.perf_counter() - started, 1)}


def _train_single(a, run: RunConfig) -> dict:
    """One process, the whole model, ``peers * batch_size`` windows per step, the same number of steps and lr."""
    corpus = load_corpus("shakespeare")
    model = build_model(run.model, run.seq_len, run.seed)
    optimizer = make_inner_optimizer(list(model.parameters()), run.diloco)
    sampler = WindowSampler(corpus.train, run.seq_len, run.batch_size * a.peers, seed="single")
    started = time.perf_counter()
    for step in range(run.max_outer_rounds * a.sync_steps):
        set_lr(optimizer, inner_lr_at(step, run.diloco))
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if run.diloco.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.diloco.grad_clip_norm)
        optimizer.step()
    result = evaluate(model, corpus.eval, run.seq_len, run.batch_size, run.eval_batches)
    return {"eval_nats_per_byte": result.nats_per_byte, "seconds": round(time.perf_counter() - started, 1)}


def loss_comparison(a) -> dict:
    import tempfile

    torch.set_num_threads(1)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        initial = build_model(a.loss_model, a.seq_len, 0)
        out["initial"] = {"eval_nats_per_byte": evaluate(initial, load_corpus("shakespeare").eval, a.seq_len,
                                                         a.batch_size, a.eval_batches).nats_per_byte}
        runs = [("spes_merge", _loss_run_config(a, "spes", True, a.rounds)),
                ("spes_no_merge", _loss_run_config(a, "spes", False, a.rounds)),
                ("diloco_full", _loss_run_config(a, "diloco", False, a.rounds))]
        if a.gap_rows:  # where SPES's gap to DiLoCo comes from: experts split over peers, or the outer step
            runs += [(f"spes_holders_{k}", _loss_run_config(a, "spes", False, a.rounds, min_holders=k))
                     for k in sorted({min(2, a.peers), a.peers}) if k != a.min_holders]
            runs.append(("diloco_plain", _loss_run_config(a, "diloco", False, a.rounds, plain_outer=True)))
        for label, run in runs:
            out[label] = asyncio.run(_train_peers(a, run, os.path.join(tmp, label)))
            print(label, out[label], file=sys.stderr, flush=True)
        out["single"] = _train_single(a, _loss_run_config(a, "diloco", False, a.rounds))
        print("single", out["single"], file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-moe", help="MoE of the memory and bytes parts")
    parser.add_argument("--loss-model", default="tiny-moe", help="MoE of the loss part")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="windows per inner step per peer (loss part)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4, help="sync rounds of the loss part")
    parser.add_argument("--sync-steps", type=int, default=25, help="inner steps per sync round (loss part)")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--inner-lr", type=float, default=2e-3)
    parser.add_argument("--merge-interval", type=int, default=5)
    parser.add_argument("--alpha-0", type=float, default=0.1)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--min-holders", type=int, default=1)
    parser.add_argument("--compression", default="fp16")
    parser.add_argument("--skip-loss", action="store_true", help="memory and bytes only")
    parser.add_argument("--gap-rows", action="store_true",
                        help="loss part: also SPES with every expert on 2 and on all peers, and DiLoCo with a plain "
                             "averaging outer step")
    parser.add_argument("--md", default=None, help="write the section into this markdown file")
    parser.add_argument("--rss-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-experts", default="", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.rss_probe:
        print(json.dumps(_rss_probe(a.model, a.seq_len, [int(e) for e in a.probe_experts.split(",") if e])))
        return 0
    for name in ("peers", "rounds", "sync_steps", "batch_size"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    n_experts = build_moe_model(a.model, a.seq_len, 0).config.n_experts
    peers = [f"peer{i}" for i in range(a.peers)]
    claims = rebalance(n_experts, {p: PeerClaim(frozenset(), n_experts) for p in peers}, a.min_holders)
    spes_mem = training_state(a.model, a.seq_len, claims[peers[0]])
    full_mem = training_state(a.model, a.seq_len, range(n_experts))
    spes_rss = peak_rss(a.model, a.seq_len, claims[peers[0]])
    full_rss = peak_rss(a.model, a.seq_len, range(n_experts))
    spes_bytes = asyncio.run(sync_bytes(a.model, a.seq_len, claims, a.compression))
    full_bytes = asyncio.run(sync_bytes(a.model, a.seq_len, {p: frozenset(range(n_experts)) for p in peers},
                                        a.compression))
    loss = None if a.skip_loss else loss_comparison(a)
    result = {"model": a.model, "peers": a.peers, "experts": n_experts, "experts_per_peer": len(claims[peers[0]]),
              "min_holders": a.min_holders, "compression": a.compression,
              "memory": {"spes": spes_mem, "diloco": full_mem}, "peak_rss": {"spes": spes_rss, "diloco": full_rss},
              "bytes_per_round": {"spes": spes_bytes, "diloco": full_bytes}, "loss": loss}
    print(json.dumps(result, indent=1))
    mb = 1e6
    sent_s, sent_d = spes_bytes["allreduce_sent"], full_bytes["allreduce_sent"]
    command = " ".join(["python scripts/bench_spes.py", *(argv if argv is not None else sys.argv[1:])])
    section = f"""{SECTION_HEADING}

`{command}` (CPU, {os.cpu_count()} cores shared). Memory and bytes: {a.model}, {n_experts} experts,
{len(claims[peers[0]])} per SPES peer of {a.peers}; memory measured after one training step, bytes of one in-process
sync round with the real matchmaking and all-reduce ({a.compression}).

| per peer | SPES | DiLoCo (full MoE) | SPES / DiLoCo |
|---|---|---|---|
| parameters (MB) | {spes_mem['params'] / mb:.1f} | {full_mem['params'] / mb:.1f} | 1.00 |
| gradients (MB) | {spes_mem['grads'] / mb:.1f} | {full_mem['grads'] / mb:.1f} | {spes_mem['grads'] / full_mem['grads']:.2f} |
| AdamW state (MB) | {spes_mem['optimizer'] / mb:.1f} | {full_mem['optimizer'] / mb:.1f} | \
{spes_mem['optimizer'] / full_mem['optimizer']:.2f} |
| training state total (MB) | {spes_mem['total'] / mb:.1f} | {full_mem['total'] / mb:.1f} | \
{spes_mem['total'] / full_mem['total']:.2f} |
| peak RSS of a process training {RSS_STEPS} steps (MB) | {spes_rss['peak_rss'] / mb:.0f} | \
{full_rss['peak_rss'] / mb:.0f} | {spes_rss['peak_rss'] / full_rss['peak_rss']:.2f} |
| its growth over the RSS after building the model (MB) | {spes_rss['growth'] / mb:.0f} | \
{full_rss['growth'] / mb:.0f} | {spes_rss['growth'] / max(1, full_rss['growth']):.2f} |
| all-reduce bytes sent per round (MB) | {sent_s / mb:.2f} | {sent_d / mb:.2f} | {sent_s / sent_d:.2f} |
| refresh of untrained experts received per round (MB) | {spes_bytes['refresh_received'] / mb:.2f} | 0 | |
| sent per round incl. refresh served (MB, mean over peers) | {(sent_s + spes_bytes['refresh_received']) / mb:.2f} | \
{sent_d / mb:.2f} | {(sent_s + spes_bytes['refresh_received']) / sent_d:.2f} |

The all-reduce carries only trained parameters; the refresh of the untrained copies (every expert a peer does not
hold, in the all-reduce codec's dtype) is most of what a peer receives. Peak RSS includes the interpreter, torch and
the model build (which may peak above training); the growth row is the peak during training (the kernel's peak
counter reset after the build) over the RSS after the build: the training state and activations.
"""
    if loss is not None:
        steps = a.rounds * a.sync_steps
        rows = [("SPES, merging warm-up (alpha_0 {}, every {} steps)".format(a.alpha_0, a.merge_interval),
                 loss["spes_merge"]), ("SPES, no merging", loss["spes_no_merge"])]
        rows += [(f"SPES, no merging, every expert trained by {label.rsplit('_', 1)[1]} peers (min_holders)", r)
                 for label, r in loss.items() if label.startswith("spes_holders_")]
        rows.append(("DiLoCo on the full MoE (every peer trains every expert)", loss["diloco_full"]))
        if "diloco_plain" in loss:
            rows.append(("DiLoCo on the full MoE, outer step = plain averaging (lr 1, no momentum)",
                         loss["diloco_plain"]))
        table = "\n".join(f"| {label} | {r['eval_nats_per_byte']:.4f} | {r['bytes_sent_per_peer_round'] / mb:.2f} | "
                          f"{r['seconds']:.0f} |" for label, r in rows)
        section += f"""
Loss: {a.loss_model}, {a.peers} in-process peers (one process, the in-process transport, real roles, matchmaking and
all-reduce; not separate processes), {a.rounds} rounds of {a.sync_steps} inner steps, {a.batch_size} windows of
{a.seq_len} bytes per step per peer, inner AdamW lr {a.inner_lr} ({a.warmup_steps} warm-up steps), Shakespeare.
Single process: the whole model, {steps} steps of {a.peers * a.batch_size} windows (the same tokens). Eval: nats per
byte on the first {a.eval_batches} eval batches, after the last round (every peer holds the same model; largest spread
between peers {max(r['eval_spread'] for k, r in loss.items() if k not in ('initial', 'single')):.1e}).

| training | eval nats/byte | bytes sent per peer per round (MB) | wall s |
|---|---|---|---|
| initial model | {loss['initial']['eval_nats_per_byte']:.4f} | | |
{table}
| single process, whole model | {loss['single']['eval_nats_per_byte']:.4f} | 0 | {loss['single']['seconds']:.0f} |

Bytes sent per round here are `RoundDone.bytes_sent` (SPES: all-reduce plus the expert refreshes served), averaged
over peers and rounds; SPES's first round is not sparse (peers that start together each claim every expert until the
first sync's re-claim spreads them). Wall seconds are not comparable: 2 cores shared with other work (load average
{os.getloadavg()[0]:.0f} at the end).
"""
    if a.md:
        replace_section(a.md, SECTION_HEADING, section)
    else:
        print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
