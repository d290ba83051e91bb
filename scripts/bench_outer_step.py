#!/usr/bin/env python3
"""Wall time of DiLoCo's outer step on the host (:meth:`protocols.diloco.outer.OuterState.apply`, Nesterov SGD over
P fp32 values), against the same step computed one operation over the whole vector at a time and checked finite with
numpy's sum (what ``OuterState.apply`` did before its chunked form and ``all_finite``'s torch sum), in the same run,
with the same bits.

The outer step sits on every round's path between the all-reduce and the next inner step (node defaults): its time is
part of the round boundary's fixed cost (docs/benchmarks.md, the GPU boundary rows). Both forms check the averaged
pseudo-gradient finite before they touch anything, write the new theta over the handed-over pseudo-gradient
(``out``, as whole-model rounds do) and the new momentum into a fresh buffer (the old state stays intact for
rollback), and check the result finite. Reported: the median over ``--reps`` of each, and their ratio.

``.venv/bin/python scripts/bench_outer_step.py --params 125000000 350000000 --reps 5 --md docs/benchmarks.md``
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchlib import machine_line, replace_section, result_args  # noqa: E402
from protocols.diloco.hyperparams import DiLoCoHyperparams  # noqa: E402
from protocols.diloco.outer import OuterState  # noqa: E402

HEADING = "## Outer step on the host (scripts/bench_outer_step.py)"


def numpy_finite(t: torch.Tensor) -> bool:
    """The finiteness check before ``all_finite`` summed tensors with torch: numpy's (single-threaded) sum."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(t.numpy().sum())) or bool(np.isfinite(t.numpy()).all())


def one_pass_per_operation(state: OuterState, g: torch.Tensor, hp: DiLoCoHyperparams) -> OuterState:
    """The baseline, ``OuterState.apply`` before its chunked form: each operation of the Nesterov step over all P values
    before the next one (the step's ``g + mu * buf`` chunk by chunk over ``g``'s buffer, to spare a scratch vector),
    and the input and both results checked finite with numpy's sum."""
    if not numpy_finite(g):
        raise ValueError("avg_pseudo_gradient contains non-finite values")
    buf = state.momentum * hp.outer_momentum
    buf.add_(g)
    scratch = torch.empty(min(g.numel(), 1 << 20))  # g + mu * buf over g's own buffer, 4 MiB at a time
    for start in range(0, g.numel(), 1 << 20):
        chunk = g[start:start + (1 << 20)]
        chunk.add_(torch.mul(buf[start:start + (1 << 20)], hp.outer_momentum, out=scratch[:chunk.numel()]))
    g.mul_(hp.outer_lr)
    theta = torch.sub(state.theta, g, out=g)
    if not (numpy_finite(theta) and numpy_finite(buf)):
        raise ValueError("the outer step overflowed")
    return OuterState(theta, buf, state.outer_round + 1, checked=True)  # checked above, as the constructor did


def measure(params: int, reps: int) -> dict:
    hp = DiLoCoHyperparams()
    gen = torch.Generator().manual_seed(0)
    state = OuterState(torch.randn(params, generator=gen), torch.randn(params, generator=gen) * 0.01, 1)
    g = torch.randn(params, generator=gen) * 1e-3
    times: dict[str, list[float]] = {"peerd": [], "baseline": []}
    results = {}
    for _ in range(reps):
        for name in times:
            handed = g.clone()
            started = time.perf_counter()
            new = state.apply(handed, hp, out=handed) if name == "peerd" else one_pass_per_operation(state, handed, hp)
            times[name].append(time.perf_counter() - started)
            results[name] = new.digest()
            del new, handed
    if results["peerd"] != results["baseline"]:
        raise SystemExit(f"bench_outer_step: the two forms disagree at P = {params}")
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, nargs="+", default=[125_000_000], help="vector sizes P (fp32 values)")
    p.add_argument("--reps", type=int, default=5, help="repetitions of each form (the median is reported)")
    p.add_argument("--md", help="write the section into this markdown file (docs/benchmarks.md)")
    args = p.parse_args()
    rows = []
    for params in args.params:
        r = measure(params, args.reps)
        print(f"P = {params:,}: peerd {r['peerd']:.3f} s, one pass per operation {r['baseline']:.3f} s", flush=True)
        rows.append(f"| {params:,} | {r['peerd']:.3f} | {r['baseline']:.3f} | {r['baseline'] / r['peerd']:.2f}x |")
    section = "\n".join([
        HEADING, "",
        "Command: `.venv/bin/python scripts/bench_outer_step.py " + " ".join(result_args(sys.argv[1:])) + "`  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}  ",
        f"Machine: {machine_line()}; torch threads {torch.get_num_threads()}.", "",
        "Nesterov outer SGD over P fp32 values on the host, the new theta written over the handed-over "
        "pseudo-gradient, the inputs and the result checked finite, median of "
        f"{args.reps} repetitions; both forms give the same state digest (checked).", "",
        "| P | peerd, chunked (s) | one pass per operation, numpy checks (s) | speed-up |",
        "|---|---|---|---|",
        *rows,
    ])
    print(section)
    if args.md:
        replace_section(args.md, HEADING, section)


if __name__ == "__main__":
    main()
