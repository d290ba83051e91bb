#!/usr/bin/env python
"""Benchmark: SWARM (stochastic wiring over replicas) vs a fixed pipeline, same model, data and time, in one run.

Two systems on the same 2-stage split of ``--model`` (Shakespeare windows of ``--seq-len`` x ``--batch-size``) and
the same four stage servers (2 per stage):

- swarm: the trainer's :class:`protocols.swarm.Wiring` picks a server per stage and micro-batch by measured
  throughput and retries a failed call on a replica (``max_retries`` 3);
- fixed: two fixed pipelines, one server per stage each (``s0a -> s1a`` and ``s0b -> s1b``); each in-flight
  micro-batch slot is tied to one pipeline, no rerouting (``max_retries`` 0). Same servers and threads as the
  swarm, so on a shared machine both get the same share of the cores.

Three scenarios, each ``--seconds`` long after ``--warmup`` seconds: (a) no failure; (b) one server killed
(``Hub.disconnect``: its streams end, it answers nothing more) at ``--kill-at`` of the run, the fixed pipeline's
stage-0 server, which is also one of the swarm's four; (c) that server at half speed (each of its computations takes
``--slow-factor`` times as long, the extra time spent asleep in its compute thread, like a slower device).

Each server emulates its own accelerator (:class:`EmulatedDevice`, ``--device-s``): a computation lasts at least its
device time, the rest spent asleep in the server's thread. On a 2-core machine shared with other work the four
servers' real computations would otherwise compete for the same cores, and the throughput would measure the cores
(a server that sleeps frees them for the others), not the wiring; ``--device-s 0`` measures that instead. Reported: samples/s over the whole window, and for (b) before and after the kill (for fixed: also
the pipeline through the killed server, which stops). Every system x scenario runs ``--repeats`` times, in an
order that alternates, and the figures are sums over the repeats (a load that changes during the run then touches
both systems alike).

Peers are in-process (:class:`peerd.transport.inprocess.Hub`; each stage server computes in its own worker thread,
``StageService(compute_thread=True)``, one request at a time; the trainer keeps ``--in-flight`` micro-batches in
flight so stages overlap), not separate processes: on the 2-core machine these numbers come from, four servers,
a trainer and their DHT and p2pd daemons as real processes would spend the run contending for the cores and
starting up (about 25 s per process under load), so the two systems would not see the same machine. The wire
protocol, codecs, wiring and retries are the same code the real peers run.

Bytes per micro-batch per codec: the encoded tensors one micro-batch moves (token ids and targets, activations
forward and their gradients back at each stage boundary), payload bytes, for fp32 (codec ``none``), fp16 and int8.

Results replace the section ``SECTION_HEADING`` of docs/benchmarks.md with ``--md``.

``--convergence``: instead, the convergence rows (``CONVERGENCE_HEADING``): the loss of an in-process swarm at equal
tokens against the same stages trained in one process on the same micro-batches
(:mod:`peerd.testing.swarm_convergence`: real stage servers, trainer and stage rounds, the rounds every
``--round-every`` micro-batches on a virtual clock): 2 servers per stage, 1 server per stage, and 2 per stage with
one stage-0 server killed at micro-batch ``--kill-at-micro-batch``. Goal: the swarm's mean loss over the last 100
micro-batches within 5% of the single process's, and its loss (mean over 50) never more than 10% above its running
minimum.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from peerd.data.corpus import WindowSampler, load_corpus  # noqa: E402
from peerd.models import build_model, split_model  # noqa: E402
from peerd.transport.inprocess import Hub  # noqa: E402
from protocols.codecs import encode_tensor  # noqa: E402
from protocols.stage_service import PipelineTrainer, StageService, encode_tokens  # noqa: E402
from protocols.swarm import SwarmConfig, Wiring  # noqa: E402

from benchlib import machine_line, replace_section, result_args  # noqa: E402

SECTION_HEADING = "## SWARM vs a fixed pipeline (scripts/bench_swarm.py)"
CONVERGENCE_HEADING = "## SWARM convergence: replicated stages vs one process (scripts/bench_swarm.py --convergence)"
SERVERS = {0: ["s0a", "s0b"], 1: ["s1a", "s1b"]}
VICTIM = "s0a"  # the fixed pipeline's stage-0 server, one of the swarm's four


def service_name(k: int) -> str:
    return f"bench.swarm.stage{k}"


#: Device time of each computation of a stage server, in units of ``--device-s`` (a backward recomputes the forward
#: and then runs backward, about 3 forwards; the last stage's loss is a forward and a backward).
DEVICE_UNITS = {"forward": 1.0, "backward": 3.0, "loss_and_backward": 3.0}


class EmulatedDevice(StageService):
    """A stage server with its own accelerator, emulated: every computation lasts at least its device time
    (``device_s`` x its units of :data:`DEVICE_UNITS`), the rest asleep in its compute thread, and ``factor`` times
    as long on a slower device (``factor`` 2: half speed). The real computation still runs on the CPU; with
    ``device_s`` 0 only the slowdown is emulated and the CPU's speed decides."""

    device_s = 0.0
    factor = 1.0

    async def _compute(self, fn, count=True):
        def on_device():
            start = time.perf_counter()
            out = fn()
            elapsed = time.perf_counter() - start
            device = max(elapsed, self.device_s * DEVICE_UNITS.get(getattr(fn, "__name__", ""), 1.0))
            time.sleep(max(0.0, self.factor * device - elapsed))
            return out

        return await super()._compute(on_device, count)


async def run_one(system: str, scenario: str, args, stages, corpus) -> dict:
    hub = Hub()
    config = SwarmConfig(stages=2, codec=args.codec, call_timeout_s=30.0, pending_timeout_s=60.0, ban_s=600.0,
                         max_retries=3 if system == "swarm" else 0, max_pending=4 * args.in_flight)
    services = {}
    for k, names in SERVERS.items():
        for name in names:
            module = copy.deepcopy(stages[k])
            optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.0)
            service = EmulatedDevice(service_name(k), module, config, optimizer=optimizer, compute_thread=True)
            service.device_s = args.device_s
            service.factor = args.slow_factor if scenario == "slow" and name == VICTIM else 1.0
            await service.start(hub.transport(name))
            services[name] = service
    streams = hub.transport("trainer").streams
    if system == "swarm":
        wirings = [Wiring(2, ban_s=config.ban_s)]
        wirings[0].set_servers(SERVERS)
    else:  # pipeline j: the j-th server of every stage
        wirings = [Wiring(2, ban_s=config.ban_s) for _ in range(2)]
        for j, wiring in enumerate(wirings):
            wiring.set_servers({k: [names[j]] for k, names in SERVERS.items()})
    trainers = [PipelineTrainer(streams, service_name, w, config, d_model=stages[0].config.d_model)
                for w in wirings]
    for j, trainer in enumerate(trainers):
        trainer._next_id = j * 10**9  # micro-batch ids stay distinct across the two pipelines' trainers
    done: list[tuple[float, int, int]] = []  # (time, samples, pipeline) of every completed micro-batch
    stop = asyncio.Event()

    async def worker(i: int) -> None:
        sampler = WindowSampler(corpus.train, args.seq_len, args.batch_size, seed=i)
        j = i % len(trainers)
        while not stop.is_set():
            x, y = sampler.next_batch()
            loss = await trainers[j].step(x.long(), y.long())
            if loss is not None:
                done.append((time.perf_counter(), x.shape[0], j))
            else:  # dropped: no server left; the fixed pipeline stays here
                await asyncio.sleep(0.2)

    workers = [asyncio.ensure_future(worker(i)) for i in range(args.in_flight)]
    await asyncio.sleep(args.warmup)
    t0 = time.perf_counter()
    t_kill = t0 + args.kill_at * args.seconds
    if scenario == "kill":
        await asyncio.sleep(t_kill - time.perf_counter())
        hub.disconnect(VICTIM)
    await asyncio.sleep(t0 + args.seconds - time.perf_counter())
    t1 = time.perf_counter()
    stop.set()
    await asyncio.wait(workers, timeout=60)
    for service in services.values():
        await service.stop()

    def samples(a: float, b: float, pipeline=None) -> int:
        return sum(n for t, n, j in done if a <= t < b and pipeline in (None, j))

    out = {"system": system, "scenario": scenario, "seconds": t1 - t0, "samples": samples(t0, t1),
           "work": {name: s.samples for name, s in services.items()}}
    for key in ("sent", "completed", "retried", "dropped"):
        out[key] = sum(getattr(w.stats, key) for w in wirings)
    if scenario == "kill":
        out.update(before_s=t_kill - t0, after_s=t1 - t_kill, before=samples(t0, t_kill),
                   after=samples(t_kill, t1))
        if system == "fixed":  # the pipeline through the killed server (pipeline 0: s0a -> s1a)
            out["after_victim_pipeline"] = samples(t_kill, t1, pipeline=0)
    return out


def merge(runs: list[dict]) -> dict:
    """Sum the repeats of one system x scenario; rates in samples per second."""
    out = dict(runs[0])
    for key in ("seconds", "samples", "sent", "completed", "retried", "dropped", "before_s", "after_s", "before",
                "after", "after_victim_pipeline"):
        if key in out:
            out[key] = sum(r[key] for r in runs)
    out["work"] = {name: sum(r["work"][name] for r in runs) for name in runs[0]["work"]}
    out["samples_per_s"] = out["samples"] / out["seconds"]
    if "before" in out:
        out["before_kill"] = out["before"] / out["before_s"]
        out["after_kill"] = out["after"] / out["after_s"]
    if "after_victim_pipeline" in out:
        out["after_kill_victim_pipeline"] = out["after_victim_pipeline"] / out["after_s"]
    return out


def bytes_per_micro_batch(stages, batch_size: int, seq_len: int, codec: str) -> int:
    """Payload bytes one micro-batch moves through ``len(stages)`` stages (forward, loss, backward)."""
    tokens = torch.randint(0, stages[0].config.vocab_size, (batch_size, seq_len))
    total = 2 * len(encode_tokens(tokens)[1])  # token ids to stage 0, targets to the last stage
    x = tokens
    with torch.no_grad():
        for stage in stages[:-1]:
            x = stage(x)  # (B, T, C)
            _, payload = encode_tensor(x, codec)
            total += 2 * len(memoryview(payload).cast("B"))  # activations forward, their gradient back (same shape)
    return total


def markdown(args, results: list[dict], wire: dict, argv: list[str]) -> str:
    by = {(r["system"], r["scenario"]): r for r in results}
    s, f = (lambda sc: by[("swarm", sc)]), (lambda sc: by[("fixed", sc)])
    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else float("nan")

    clean_ratio = ratio(s("clean")["samples_per_s"], f("clean")["samples_per_s"])
    kill_ratio = ratio(s("kill")["after_kill"], s("kill")["before_kill"])
    kill_vs_clean = ratio(s("kill")["after_kill"], s("clean")["samples_per_s"])
    slow_ratio = ratio(s("slow")["samples_per_s"], f("slow")["samples_per_s"])
    lines = [
        SECTION_HEADING, "",
        f"`{' '.join(['.venv/bin/python', 'scripts/bench_swarm.py'] + argv)}` on {time.strftime('%Y-%m-%d')}; "
        + machine_line() + ". In-process peers (see the script's docstring for why): the figures compare the two "
        "systems within this one run on a shared, loaded machine, not absolute speeds.",
        "",
        f"Model `{args.model}` in 2 stages, micro-batches of {args.batch_size} x {args.seq_len} tokens of Shakespeare, "
        f"{args.in_flight} in flight, codec {args.codec}, emulated device time {args.device_s:g} s per stage forward "
        f"({'the CPU alone' if not args.device_s else 'backward and loss 3x'}), "
        f"{args.repeats} x {args.seconds:g} s per system and "
        f"scenario (each after {args.warmup:g} s of warm-up); "
        f"fault on `{VICTIM}` (the fixed pipeline's stage-0 server, one of the swarm's 4).",
        "",
        "| scenario | swarm samples/s | fixed samples/s | swarm: sent / completed / retried / dropped | "
        "fixed: sent / completed / dropped |",
        "|---|---|---|---|---|",
    ]
    for sc, what in (("clean", "(a) no failure"), ("kill", f"(b) `{VICTIM}` killed at {args.kill_at:.0%}"),
                     ("slow", f"(c) `{VICTIM}` at 1/{args.slow_factor:g} speed")):
        a, b = s(sc), f(sc)
        extra_a = f" (before kill {a['before_kill']:.1f}, after {a['after_kill']:.1f})" if sc == "kill" else ""
        extra_b = (f" (before kill {b['before_kill']:.1f}, after {b['after_kill']:.1f}; the pipeline through the "
                   f"killed server after: {b['after_kill_victim_pipeline']:.1f})" if sc == "kill" else "")
        lines.append(f"| {what} | {a['samples_per_s']:.1f}{extra_a} | {b['samples_per_s']:.1f}{extra_b} | "
                     f"{a['sent']} / {a['completed']} / {a['retried']} / {a['dropped']} | "
                     f"{b['sent']} / {b['completed']} / {b['dropped']} |")
    slow = s("slow")["work"]
    share = slow[VICTIM] / max(1, slow["s0a"] + slow["s0b"])
    lines += [
        "",
        f"Goals: (a) swarm / fixed = **{clean_ratio:.2f}** (goal: the swarm within 10% of the fixed pipeline, "
        f">= 0.90: {'met' if clean_ratio >= 0.90 else 'not met'}); (b) swarm after the kill / before it in the "
        f"same runs = **{kill_ratio:.2f}** (goal >= 0.80: {'met' if kill_ratio >= 0.8 else 'not met'}; vs the "
        f"no-failure runs {kill_vs_clean:.2f}), while the fixed pipeline through the killed server stops "
        f"({f('kill')['after_kill_victim_pipeline']:.1f} samples/s after the kill); (c) swarm / fixed with a half-speed server = "
        f"**{slow_ratio:.2f}** (goal > 1: {'met' if slow_ratio > 1 else 'not met'}); the slowed server took "
        f"{share:.0%} of its stage's samples in the swarm (its fair share at 1/{args.slow_factor:g} speed: "
        f"{1 / (1 + args.slow_factor):.0%}).",
        "",
        f"Bytes per micro-batch ({args.batch_size} x {args.seq_len} tokens, 2 stages, payloads): "
        + ", ".join(f"{codec} {n:,} B" for codec, n in wire.items()) + ".",
    ]
    return "\n".join(lines) + "\n"


def convergence_rows(args, argv: list[str]) -> int:
    """Run the convergence variants (see the module docstring); print each as JSON, write the section with --md."""
    from peerd.run_config import RunConfig
    from peerd.testing.swarm_convergence import convergence, micro_batches, single_process_losses, swarm_losses
    from protocols.diloco import DiLoCoHyperparams

    run = RunConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, eval_batches=0,
                    parallelism="swarm",
                    swarm=SwarmConfig(stages=2, codec=args.codec, call_timeout_s=60.0, pending_timeout_s=120.0,
                                      sync_interval_s=0, rebalance_period_s=3600.0),
                    diloco=DiLoCoHyperparams(inner_lr=3e-3, inner_weight_decay=0.0))  # swarm-tiny's inner AdamW
    batches = micro_batches(run, args.micro_batches)
    started = time.perf_counter()
    single = single_process_losses(run, batches)
    print(json.dumps({"variant": "single process", "last100": sum(single[-100:]) / 100,
                      "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    variants = [("2 servers per stage", dict(replicas=2)), ("1 server per stage", dict(replicas=1)),
                (f"2 per stage, one stage-0 server killed at micro-batch {args.kill_at_micro_batch}",
                 dict(replicas=2, kill=(args.kill_at_micro_batch, 0, 0)))]
    rows = []
    for name, kwargs in variants:
        started = time.perf_counter()
        losses = asyncio.run(swarm_losses(run, batches, round_every=args.round_every, **kwargs))
        c = convergence(losses, single)
        row = {"variant": name, "last100": c.last[0], "single_last100": c.last[1], "ratio": c.ratio,
               "max_rise": c.max_rise, "seconds": round(time.perf_counter() - started, 1),
               "at": {n: sum(losses[n - 50:n]) / 50 for n in range(200, len(losses) + 1, 200)}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.md:
        lines = [
            CONVERGENCE_HEADING, "",
            f"`{' '.join(['.venv/bin/python', 'scripts/bench_swarm.py'] + result_args(argv))}` on "
            f"{time.strftime('%Y-%m-%d')}; " + machine_line() + ".",
            "",
            f"Model `{args.model}` in 2 stages, {args.micro_batches} micro-batches of {args.batch_size} x "
            f"{args.seq_len} tokens of Shakespeare (the same ones, in the same order, for every row), inner AdamW "
            f"lr 3e-3 (swarm-tiny's), activations {args.codec}; in-process stage servers "
            f"(`peerd.testing.swarm_convergence`), a stage round of every server every {args.round_every} "
            f"micro-batches. Single process: the same stages, one AdamW step each per micro-batch, last-100 mean "
            f"**{rows[0]['single_last100']:.3f}**. Goal: last-100 mean within 5% of it, and the loss (mean over 50) "
            f"never more than 10% above its running minimum.",
            "",
            "| variant | loss (mean of 50) at " + " / ".join(str(n) for n in rows[0]["at"]) + " micro-batches | "
            "last-100 mean | vs single process | max rise over running minimum | goal |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            met = r["ratio"] <= 1.05 and r["max_rise"] <= 0.10
            lines.append(f"| {r['variant']} | {' / '.join(f'{v:.2f}' for v in r['at'].values())} | "
                         f"{r['last100']:.3f} | {r['ratio'] - 1:+.1%} | {r['max_rise']:.1%} | "
                         f"{'met' if met else 'not met'} |")
        replace_section(args.md, CONVERGENCE_HEADING, "\n".join(lines) + "\n")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seconds", type=float, default=15.0, help="measured time per run")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--in-flight", type=int, default=4, help="micro-batches the trainer keeps in flight")
    p.add_argument("--kill-at", type=float, default=0.3, help="fraction of --seconds at which the server dies")
    p.add_argument("--slow-factor", type=float, default=2.0)
    p.add_argument("--codec", default="fp16")
    p.add_argument("--threads", type=int, default=1, help="torch threads per computation")
    p.add_argument("--device-s", type=float, default=0.15,
                   help="emulated device time of one stage forward, seconds (0: the CPU's own speed)")
    p.add_argument("--repeats", type=int, default=2, help="runs per system and scenario, alternating")
    p.add_argument("--scenarios", default="clean,kill,slow")
    p.add_argument("--md", default=None, help="write the section into this markdown file (docs/benchmarks.md)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--convergence", action="store_true",
                   help="run the convergence rows (swarm vs one process at equal tokens) instead")
    p.add_argument("--micro-batches", type=int, default=2000, help="--convergence: micro-batches per variant")
    p.add_argument("--round-every", type=int, default=10, help="--convergence: micro-batches between stage rounds")
    p.add_argument("--kill-at-micro-batch", type=int, default=500, help="--convergence: when the server dies")
    args = p.parse_args(argv)
    if args.convergence:
        if args.micro_batches < 200 or args.round_every < 1:
            p.error("--micro-batches must be >= 200 and --round-every >= 1")
        if not 0 < args.kill_at_micro_batch < args.micro_batches:
            p.error("--kill-at-micro-batch must be in (0, --micro-batches)")
        torch.set_num_threads(args.threads)
        return convergence_rows(args, argv)
    for name in ("seconds", "warmup", "slow_factor"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.device_s < 0:
        p.error("--device-s must be >= 0")
    if not 0 < args.kill_at < 1:
        p.error("--kill-at must be in (0, 1)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    stages = split_model(build_model(args.model, seq_len=args.seq_len, seed=0), 2)
    corpus = load_corpus("shakespeare")
    if args.repeats < 1 or args.in_flight < 2:
        p.error("--repeats must be >= 1 and --in-flight >= 2 (one slot per fixed pipeline at least)")
    runs: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for scenario in args.scenarios.split(","):
            for system in (("swarm", "fixed") if rep % 2 == 0 else ("fixed", "swarm")):
                r = asyncio.run(run_one(system, scenario, args, stages, corpus))
                print(json.dumps(r), flush=True)
                runs.setdefault((system, scenario), []).append(r)
    results = [merge(rs) for rs in runs.values()]
    wire = {name: bytes_per_micro_batch(stages, args.batch_size, args.seq_len, codec)
            for name, codec in (("fp32", "none"), ("fp16", "fp16"), ("int8", "int8"))}
    print(json.dumps({"bytes_per_micro_batch": wire}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "bytes_per_micro_batch": wire}, f, indent=1)
    if args.md and args.scenarios == "clean,kill,slow":
        replace_section(args.md, SECTION_HEADING, markdown(args, results, wire, result_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
