#!/usr/bin/env python
"""Benchmark: SkipPipe (stage skipping) against the full pipeline on a swarm with one slow server.

Three parts, in one run, on the same model, data and tokens:

- Training (in-process: one asyncio loop, the in-process transport ``peerd.transport.inprocess.Hub``, real
  :class:`StageService` servers and a :class:`PipelineTrainer` planned by :class:`protocols.skippipe.SkipPlanner`):
  a ``--layers``-block model (the tiny preset's width) cut into ``--stages`` stages, one server per stage, the
  server of stage ``--slow-stage`` ``--slow-factor`` times slower (it waits ``factor - 1`` times its compute
  after computing, like a slower remote machine). For each skip ratio k in ``--skip-ratios``: ``--iterations``
  iterations of ``--micro-batches`` micro-batches sent concurrently, from the same initial weights and the same
  batches. Reported: mean wall time per iteration (iterations after the first two), the schedule's predicted
  makespan per iteration (nominal times: 1 per stage, the slow one ``factor``; load-independent), and the eval
  loss through all stages.
- Inference with stages missing: eval perplexity of each trained model with 0%, 25% and 50% of the middle stages
  missing (averaged over every choice of which stages).
- Scheduling: the greedy earliest-finish-time schedule against the best over every server assignment
  (:func:`protocols.skippipe.best_assignment_schedule`) and against round-robin, on ``--instances`` random small
  instances.

Results replace the section ``SECTION_HEADING`` of docs/benchmarks.md with ``--md``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import math
import os
import random
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from peerd.data.corpus import WindowSampler, load_corpus  # noqa: E402
from peerd.models import split_model  # noqa: E402
from peerd.models.transformer import MODEL_SIZES, Transformer, TransformerConfig  # noqa: E402
from peerd.commands.swarm_infer import evaluate_swarm  # noqa: E402
from peerd.transport.inprocess import Hub  # noqa: E402
from protocols.skippipe import (  # noqa: E402
    SkipPlanner, best_assignment_schedule, generate_paths, schedule, skips_per_path,
)
from protocols.stage_service import PipelineTrainer, StageService  # noqa: E402
from protocols.swarm import SwarmConfig, Wiring  # noqa: E402

from benchlib import machine_line, replace_section, result_args  # noqa: E402

SECTION_HEADING = "## SkipPipe: stage skipping on a swarm with a slow server (scripts/bench_skippipe.py)"


def service_name(k: int) -> str:
    return f"bench.swarm.stage{k}"


class SlowService(StageService):
    """A server ``factor`` times slower: after computing it waits ``factor - 1`` times its compute time (without
    holding the event loop, as a slower remote machine would)."""

    factor = 3.0

    async def _slow(self, coro):
        before = self.compute_s
        out = await coro
        await asyncio.sleep((self.factor - 1) * (self.compute_s - before))
        return out

    async def rpc_forward(self, request):
        return await self._slow(super().rpc_forward(request))

    async def rpc_backward(self, request):
        return await self._slow(super().rpc_backward(request))

    async def rpc_loss(self, request):
        return await self._slow(super().rpc_loss(request))


async def train_one(a, k: float, stages, batches, eval_tokens) -> dict:
    config = SwarmConfig(stages=a.stages, codec="fp16", skip_ratio=k, call_timeout_s=120.0, pending_timeout_s=300.0)
    hub = Hub()
    services = []
    for j in range(a.stages):
        module = copy.deepcopy(stages[j])
        optimizer = torch.optim.AdamW(module.parameters(), lr=a.lr, weight_decay=0.0)
        cls = SlowService if j == a.slow_stage else StageService
        service = cls(service_name(j), module, config, optimizer=optimizer)
        service.factor = a.slow_factor
        await service.start(hub.transport(f"s{j}"))
        services.append(service)
    wiring = Wiring(a.stages)
    wiring.set_servers({j: [f"s{j}"] for j in range(a.stages)})
    trainer = PipelineTrainer(hub.transport("trainer").streams, service_name, wiring, config, d_model=stages[0].config.d_model)
    planner = SkipPlanner(a.stages, k, window=a.micro_batches * 4, seed=0) if k > 0 else None
    nominal = {j: {f"s{j}": a.slow_factor if j == a.slow_stage else 1.0} for j in range(a.stages)}
    times, predicted, losses = [], [], []
    batch = iter(batches)
    for _ in range(a.iterations):
        plans = [planner.next(wiring) if planner else (tuple(range(a.stages)), {}) for _ in range(a.micro_batches)]
        predicted.append(schedule([p for p, _ in plans], nominal).makespan)
        steps = []
        for path, prefer in plans:
            x, y = next(batch)
            steps.append(trainer.step(x, y, path=path, prefer=prefer))
        start = time.perf_counter()
        got = await asyncio.gather(*steps)
        times.append(time.perf_counter() - start)
        losses.extend(l for l in got if l is not None)
    assert wiring.stats.dropped == 0, wiring.stats
    full = await evaluate_swarm(trainer, eval_tokens, a.seq_len, a.batch_size, a.eval_batches)
    # inference with middle stages missing: every choice of which, averaged
    middle = list(range(1, a.stages - 1))
    by_missing = {}
    for share in (0.0, 0.25, 0.5):
        n = round(share * len(middle))
        nats = []
        for gone in itertools.combinations(middle, n):
            path = [j for j in range(a.stages) if j not in gone]
            total = 0.0
            for b in range(a.eval_batches):
                idx = (torch.arange(a.batch_size) + b * a.batch_size)[:, None] * a.seq_len + torch.arange(a.seq_len + 1)
                total += await trainer.infer(eval_tokens[idx[:, :-1]].long(), eval_tokens[idx[:, 1:]].long(), path=path)
            nats.append(total / a.eval_batches)
        by_missing[share] = (n, statistics.mean(nats))
    for s in services:
        await s.stop()
    measured = times[2:] if len(times) > 2 else times
    return dict(k=k, skips=skips_per_path(a.stages, k), iteration_s=statistics.mean(measured),
                predicted=statistics.mean(predicted), eval_nats=full.nats_per_byte, train_last=statistics.mean(losses[-a.micro_batches * 3:]),
                missing=by_missing, visits=[s.backwards for s in services])


def compare_schedulers(instances: int, seed: int) -> dict:
    rng = random.Random(seed)
    greedy_ratio, rr_ratio = [], []
    for _ in range(instances):
        servers = {j: {f"s{j}{i}": rng.choice([1.0, 1.0, 2.0, 3.0]) for i in range(rng.choice([1, 2]))}
                   for j in range(4)}
        paths = generate_paths(4, 0.25, 3, seed=rng.random())
        best = best_assignment_schedule(paths, servers).makespan
        greedy_ratio.append(schedule(paths, servers).makespan / best)
        # round-robin: micro-batch i goes to server i mod n of every stage, whatever their speeds
        assign = {(mb, j): sorted(servers[j])[mb % len(servers[j])] for mb, p in enumerate(paths) for j in p}
        rr_ratio.append(schedule(paths, servers, assignment=assign).makespan / best)
    return dict(instances=instances, greedy_mean=statistics.mean(greedy_ratio), greedy_max=max(greedy_ratio),
                greedy_optimal=sum(r < 1 + 1e-9 for r in greedy_ratio), rr_mean=statistics.mean(rr_ratio),
                rr_max=max(rr_ratio))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=6)
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (tiny preset's width), >= --stages")
    p.add_argument("--slow-stage", type=int, default=2)
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--skip-ratios", default="0,0.25,0.3334,0.5")
    p.add_argument("--iterations", type=int, default=24)
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per iteration, sent concurrently")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--instances", type=int, default=30, help="random instances of the scheduler comparison")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--md", default=None, help="write the section into this markdown file")
    a = p.parse_args()
    if not 3 <= a.stages <= a.layers or not 0 < a.slow_stage < a.stages - 1:
        p.error("need 3 <= --stages <= --layers and a middle --slow-stage")
    torch.set_num_threads(a.threads)
    machine = machine_line()
    started = time.time()
    ratios = [float(x) for x in a.skip_ratios.split(",")]
    width = MODEL_SIZES["tiny"]
    model = Transformer(TransformerConfig(seq_len=a.seq_len, d_model=width["d_model"], n_layers=a.layers,
                                          n_heads=width["n_heads"], mlp_hidden=width["mlp_hidden"]), seed=a.seed)
    stages = split_model(model, a.stages)
    corpus = load_corpus("shakespeare")
    sampler = WindowSampler(corpus.train, a.seq_len, a.batch_size, seed=a.seed)
    batches = [tuple(t.long() for t in sampler.next_batch()) for _ in range(a.iterations * a.micro_batches)]
    results = []
    for k in ratios:
        r = asyncio.run(train_one(a, k, stages, batches, corpus.eval))
        results.append(r)
        print(f"k={k:.2f} skips/path={r['skips']} iteration {r['iteration_s']:.3f} s (predicted {r['predicted']:.1f}) "
              f"eval {r['eval_nats']:.4f} nats/B; missing {r['missing']}; backwards per stage {r['visits']}",
              flush=True)
    sched = compare_schedulers(a.instances, a.seed)
    print(f"scheduler: {sched}", flush=True)
    base = results[0]
    lines = [
        SECTION_HEADING, "",
        f"Command: `python scripts/bench_skippipe.py {' '.join(result_args(sys.argv[1:]))}` ({time.time() - started:.0f} s).",
        f"Machine: {machine}. **A shared, loaded 2-core machine: wall times are noisy; compare only within this run.**",
        "",
        f"Model: {a.layers} blocks of the tiny preset's width (d_model {width['d_model']}), {a.stages} stages, one "
        f"server each; the server of stage {a.slow_stage} is {a.slow_factor:g}x slower. Every k trains from the same "
        f"weights on the same {a.iterations} x {a.micro_batches} micro-batches of {a.batch_size} x {a.seq_len} "
        "bytes (Shakespeare), the micro-batches of an iteration sent at once; all servers share one event loop "
        "(one CPU), the slow server's extra time is a wait. Predicted = the schedule's makespan per iteration "
        "with nominal times (1 per stage visit, the slow stage "
        f"{a.slow_factor:g}; backward 2x forward). Eval through all stages, {a.eval_batches} x {a.batch_size} "
        "windows.", "",
        "| k | stages skipped per path | iteration (s) | vs k=0 | predicted makespan | vs k=0 | eval loss (nats/B) | "
        "micro-batches trained per stage |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['k']:.2f} | {r['skips']} | {r['iteration_s']:.3f} | "
                     f"{100 * (r['iteration_s'] / base['iteration_s'] - 1):+.0f}% | {r['predicted']:.1f} | "
                     f"{100 * (r['predicted'] / base['predicted'] - 1):+.0f}% | {r['eval_nats']:.4f} | "
                     f"{', '.join(map(str, r['visits']))} |")
    lines += ["", "Inference with middle stages missing (each missing stage is the identity; perplexity = "
              "exp(eval nats/B), averaged over every choice of the missing stages):", "",
              "| trained with k | 0% missing | 25% missing | 50% missing | 50% vs 0% |", "|---|---|---|---|---|"]
    for r in results:
        ppl = {s: math.exp(v[1]) for s, v in r["missing"].items()}
        lines.append(f"| {r['k']:.2f} | {ppl[0.0]:.2f} | {ppl[0.25]:.2f} ({r['missing'][0.25][0]} stage) | "
                     f"{ppl[0.5]:.2f} ({r['missing'][0.5][0]} stages) | {100 * (ppl[0.5] / ppl[0.0] - 1):+.0f}% |")
    lines += ["", f"Scheduling ({sched['instances']} random instances: 4 stages of 1-2 servers of speed 1-3, 3 "
              "micro-batches, k = 0.25; makespan relative to the best over every server assignment): greedy "
              f"earliest-finish-time mean {sched['greedy_mean']:.3f}, worst {sched['greedy_max']:.3f}, optimal on "
              f"{sched['greedy_optimal']} of {sched['instances']}; round-robin mean {sched['rr_mean']:.3f}, worst "
              f"{sched['rr_max']:.3f}. The greedy rule replaces the reference's conflict-based search + A* (see "
              "`protocols/skippipe.py`).", ""]
    section = "\n".join(lines)
    print(section)
    if a.md:
        replace_section(a.md, SECTION_HEADING, section)


if __name__ == "__main__":
    main()
