#!/usr/bin/env python
"""Benchmark: bytes per outer round and eval loss of DiLoCo variants at equal tokens, in one process.

``--peers`` DiLoCo workers (the real :class:`peerd.roles.diloco.DiLoCoRole`, the real matchmaking, all-reduce and
codecs) on the in-process transport (no sockets, no daemons), for each variant in turn: same model, data, seeds and
tokens. Per variant it prints the mean bytes each peer sent per outer round, the ratio to the first variant (fp16
pseudo-gradients and answers, today's DiLoCo), and the held-out eval loss of theta_outer after the last round. Short
defaults; everything runs on one machine's CPU, so it measures bytes and loss, not wall time.

Example: ``python scripts/bench_outer_codecs.py --steps 60 --h 10 --variants fp16 fp4/fp4 topk/fp16 topk/fp4``;
``topk-gather`` and ``topk-gather+sparseloco`` for the sparse all-gather (:mod:`protocols.allgather`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from peerd.config import NodeConfig  # noqa: E402
from peerd.events import RoundDone  # noqa: E402
from peerd.roles.base import RunContext  # noqa: E402
from peerd.roles.diloco import DiLoCoRole  # noqa: E402
from peerd.run_config import AveragingConfig, RunConfig  # noqa: E402
from peerd.transport.inprocess import Hub  # noqa: E402
from protocols.allreduce import AllReduceConfig  # noqa: E402
from protocols.diloco import DiLoCoHyperparams  # noqa: E402
from protocols.matchmaking import MatchmakingConfig  # noqa: E402


def run_config(a: argparse.Namespace, variant: str) -> RunConfig:
    """``variant``: ``up/answers`` codecs (``fp16`` alone = fp16/fp16) or ``topk-gather`` (the sparse all-gather,
    no answers), optionally ``+F<n>`` fragments, ``+delayed``, ``+k<fraction>`` (top-k density, default 0.02),
    ``+olr<lr>`` (outer lr), ``+ef<decay>`` (error feedback decay; 0 = none), ``+sparseloco`` (SparseLoCo's
    outer step: no outer momentum, outer lr 1, error feedback decay 0.95, arXiv 2508.15706) and ``+tau<n>`` (with
    ``+delayed``: each background exchange lands n inner steps after it began, :class:`LandAfterSteps`)."""
    codecs, *extra = variant.split("+")
    exchange, topk_fraction = "reduce", AllReduceConfig.topk_fraction
    if codecs.endswith("-gather"):
        codecs, exchange = codecs[: -len("-gather")], "gather"
    up, _, down = codecs.partition("/")
    diloco = dict(inner_steps=a.h, warmup_steps=a.warmup, inner_lr=a.lr)
    for item in extra:
        if item == "delayed":
            diloco["overlap"] = "delayed"
        elif item.startswith("olr") and item[3:].replace(".", "", 1).isdigit():
            diloco["outer_lr"] = float(item[3:])
        elif item.startswith("k") and item[1:].replace(".", "", 1).isdigit():
            topk_fraction = float(item[1:])
        elif item.startswith("ef") and item[2:].replace(".", "", 1).isdigit():
            diloco["error_feedback_decay"] = float(item[2:])
        elif item == "sparseloco":
            diloco.update(outer_momentum=0.0, outer_lr=1.0, error_feedback_decay=0.95)
        elif item.startswith("F"):
            diloco["fragments"] = int(item[1:])
        elif item.startswith("tau") and item[3:].isdigit():
            pass  # run_variant: each background exchange lands tau inner steps after it was sent
        else:
            raise ValueError(f"variant {variant!r}: unknown part {item!r}")
    averaging = AveragingConfig(
        matchmaking_config=MatchmakingConfig(min_group_size=a.peers, matchmaking_timeout_s=30.0, request_timeout_s=5.0),
        allreduce_config=AllReduceConfig(compression=up, result_compression=down or "auto", sender_timeout_s=30.0,
                                         reducer_timeout_s=60.0, exchange=exchange,
                                         topk_fraction=topk_fraction))
    return RunConfig(model=a.model, seq_len=a.seq_len, batch_size=a.batch, eval_batches=a.eval_batches,
                     max_outer_rounds=a.steps // a.h, eval_every=a.steps // a.h, diloco=DiLoCoHyperparams(**diloco),
                     averaging=averaging)


class StepCounter:
    """A worker's inner steps, counted from its ``inner`` events (one per step with ``log_every_steps = 1``)."""

    def __init__(self):
        self.count = 0
        self._stepped = asyncio.Event()

    def on_event(self, event) -> None:
        if event.name == "inner":
            self.count += 1
            self._stepped.set()

    async def reached(self, target: int) -> None:
        while self.count < target:
            self._stepped.clear()
            await self._stepped.wait()


class LandAfterSteps:
    """An outer sync whose exchanges (the delayed overlap's background all-reduces) return no sooner than ``tau``
    inner steps of its worker after they began: the staleness of a WAN all-reduce lasting tau steps (Streaming
    DiLoCo's tau), here where the in-process all-reduce lasts about one step. ``tau`` must stay below the steps
    between two boundaries (compute waits for the exchange at the next one)."""

    def __init__(self, inner, steps: StepCounter, tau: int):
        self.inner, self.steps, self.tau = inner, steps, tau

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def exchange(self, *args, **kwargs):
        target = self.steps.count + self.tau
        outcome = await self.inner.exchange(*args, **kwargs)
        await self.steps.reached(target)
        return outcome


def _tau(variant: str) -> int:
    return next((int(item[3:]) for item in variant.split("+")[1:] if item.startswith("tau")), 0)


async def run_variant(a: argparse.Namespace, variant: str, workdir: str) -> dict:
    run = run_config(a, variant)
    hub = Hub()
    workers, done = [], []
    tau = _tau(variant)
    for i in range(a.peers):
        node = NodeConfig(checkpoint_dir=os.path.join(workdir, variant.replace("/", "_"), str(i)), threads=1,
                          device="cpu", log_every_steps=1)
        ctx = RunContext.build("bench", run, node, hub.transport(f"peer-{i}"))
        if tau:
            counter = StepCounter()
            ctx.events.subscribe(counter.on_event)
            ctx.wrap_sync = lambda sync, counter=counter: LandAfterSteps(sync, counter, tau)
        w = DiLoCoRole(ctx)
        w.ctx.events.subscribe(lambda e: done.append(e) if isinstance(e, RoundDone) else None)
        workers.append(w)
    started = time.perf_counter()
    await asyncio.gather(*[w.run() for w in workers])
    rounds = [e for e in done]
    evals = [e.eval_nats_per_byte for e in rounds if e.outer_round == run.max_outer_rounds]
    digests = {w.digest() for w in workers}
    return dict(variant=variant, rounds=max(w.outer.outer_round for w in workers),
                sent_per_round=sum(e.bytes_sent for e in rounds) / max(1, len(rounds)),
                dp_per_round=sum(e.dp_equivalent_bytes for e in rounds) / max(1, len(rounds)),
                eval=sum(evals) / len(evals) if evals and None not in evals else None,
                identical=len(digests) == 1, failed=sum(w.stats.rounds_failed for w in workers),
                wall_s=time.perf_counter() - started)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["fp16", "fp4/fp4", "topk/fp16", "topk/fp4"],
                   help="up/answers codecs or topk-gather, + F<n> fragments, + delayed, + k<top-k fraction>, "
                        "+ olr<outer lr>, + ef<error feedback decay>, + sparseloco, + tau<steps the exchange lasts>; "
                        "the first is the "
                        "reference")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--model", default="tiny", choices=("tiny", "small"))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=60, help="inner steps per peer (a multiple of --h)")
    p.add_argument("--h", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8)
    a = p.parse_args()
    if a.steps % a.h:
        p.error("--steps must be a multiple of --h")
    try:
        for v in a.variants:
            run_config(a, v)
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="bench_outer_codecs_")
    rows = []
    for v in a.variants:
        r = asyncio.run(run_variant(a, v, workdir))
        rows.append(r)
        print(f"{v}: {r}", flush=True)
    ref = rows[0]
    print()
    print(f"| variant | rounds | sent per peer per round | bytes vs {ref['variant']} | vs per-step data parallel | "
          f"eval nats/byte | eval vs {ref['variant']} | theta_outer identical | failed rounds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = ref["sent_per_round"] / r["sent_per_round"] if r["sent_per_round"] else float("nan")
        dp = r["dp_per_round"] / r["sent_per_round"] if r["sent_per_round"] else float("nan")
        ev = f"{r['eval']:.4f}" if r["eval"] is not None else "-"
        rel = f"{r['eval'] / ref['eval'] - 1:+.2%}" if r["eval"] is not None and ref["eval"] else "-"
        print(f"| {r['variant']} | {r['rounds']} | {r['sent_per_round'] / 1e6:.3f} MB | {ratio:.1f}x | {dp:.0f}x | "
              f"{ev} | {rel} | {r['identical']} | {r['failed']} |")
    print("\nper-step data parallel: a fp32 butterfly all-reduce of the gradients after every inner step "
          "(2 (n-1)/n * 4 bytes per parameter per step, H steps per round)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
