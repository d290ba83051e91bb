#!/usr/bin/env python3
"""Tokens/s and model FLOPs utilization of a peerd peer's inner steps vs a plain PyTorch loop of the same model,
precision and batch, in one run.

peerd's side is the DiLoCo role itself (``DiLoCoRole.train_until_quota``: its sampler, inner step, precision,
micro-batches and optimizer, on an in-process transport with no other peer, evaluation off), so what is measured is
what a volunteer's daemon does between outer rounds. The baseline is the loop a PyTorch user would write: the same
model on the device, random token batches drawn on the device, ``torch.autocast`` at the same precision, AdamW
(fused on CUDA), ``loss.backward()``, one host-device sync at the end. Steps before ``--warmup`` (and the
``torch.compile`` step with ``--compile``) are not timed.

MFU = achieved model FLOPs / peak: training FLOPs per token = 6 * parameters (without the embedding) + 12 * layers
* d_model * seq_len (attention scores and values; Chowdhery et al. 2022, PaLM, appendix B); the peak is the GPU's
dense bf16/fp16 tensor-core rate from a small table (``--peak-tflops`` to set it). On a CPU the small presets run and
MFU is not reported (no meaningful peak), and the script says so.

Each side is measured ``--repeats`` times, interleaved, and the best of each is reported.

``--memory-fit``: for each of ``--fit-presets`` at each of ``--caps`` GiB (the process capped with
``torch.cuda.set_per_process_memory_fraction(cap / total)``, as on a card of that size), the micro-batch and
activation checkpointing that ``peerd join`` chooses with nothing set (:func:`peerd.hardware.memory.fit_node`), the
predicted peak, the measured ``torch.cuda.max_memory_allocated`` over ``--fit-steps`` inner steps of the DiLoCo role,
whether it ran, and its tokens/s. Without a GPU the plans and predictions are printed, nothing runs.

``--boundary``: the fixed cost of an outer round beyond the all-reduce, per preset, in-process with one peer (the
average of one pseudo-gradient is itself, so the all-reduce is left out), with the node's defaults: the
pseudo-gradient (theta_local to the host, minus theta_outer), the outer Nesterov step, theta_outer back into the
model, what the round waits for of the checkpoint and of the held-out evaluation of the run's default
``eval_batches`` (on a GPU both go to the background by default; how long they then take is reported beside, as is
the new state's SHA-256 digest, which a peer computes in a worker thread while training goes on), at a first
boundary and a second, steady one (the table's).

Usage: python scripts/bench_gpu.py [--device cuda] [--presets small 125m ...] [--steps 30] [--batch-size 16]
       [--seq-len 1024] [--precision auto] [--compile] [--micro-batch-size M] [--local-devices cuda:0,cuda:1]
       [--memory-fit [--caps 24 12 8] [--fit-presets 125m 350m 1.1b]] [--boundary] [--only-extra]
       [--json OUT.json] [--md docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchlib import machine_line, replace_section, result_args  # noqa: E402
from peerd.config import NodeConfig  # noqa: E402
from peerd.worker.inner_step import enable_tf32, resolve_precision  # noqa: E402
from peerd.models import build_model, get_preset  # noqa: E402
from peerd.roles.base import RunContext  # noqa: E402
from peerd.roles.diloco import DiLoCoRole  # noqa: E402
from peerd.run_config import RunConfig  # noqa: E402
from peerd.transport.inprocess import Hub  # noqa: E402
from protocols.diloco import DiLoCoHyperparams, make_inner_optimizer  # noqa: E402

HEADING = "## GPU use: a peer's inner steps vs a plain PyTorch loop"
FIT_HEADING = "## GPU memory: predicted vs measured peak at 24/12/8 GiB caps"
BOUNDARY_HEADING = "## The outer round's fixed cost beyond the all-reduce"
#: Dense bf16/fp16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of the CUDA device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "RTX 4090": 165.2,
               "RTX 3090": 71.0, "L4": 121.0, "T4": 65.0, "V100": 125.0}


def flops_per_token(preset: str, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of a dense preset at ``seq_len``."""
    p = get_preset(preset)
    d, layers = p.shape["d_model"], p.shape["n_layers"]
    non_embedding = p.parameter_count() - 256 * d
    return 6.0 * non_embedding + 12.0 * layers * d * seq_len


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(preset: str, args, device: torch.device) -> float:
    """Tokens/s of the baseline loop."""
    model = build_model(preset, args.seq_len, seed=0).to(device)
    precision = resolve_precision(args.precision, device)
    forward = torch.compile(model) if args.compile else model
    hp = DiLoCoHyperparams()
    optimizer = make_inner_optimizer(model.parameters(), hp, device.type)
    scaler = torch.amp.GradScaler(device.type) if precision.loss_scaling else None
    gen = torch.Generator(device=device).manual_seed(0)

    def step() -> torch.Tensor:
        tokens = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), device=device, generator=gen)
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast():
            _, loss = forward(tokens[:, :-1], tokens[:, 1:])
        if scaler is not None:
            scaler.scale(loss.float()).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.float().backward()
            optimizer.step()
        return loss.detach()

    for _ in range(args.warmup + (1 if args.compile else 0)):
        step()
    sync(device)
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    float(loss)
    sync(device)
    return args.steps * args.batch_size * args.seq_len / (time.perf_counter() - started)


def peerd_role(preset: str, args, device: torch.device, tmp: str, local_devices: tuple[str, ...] = ()) -> float:
    """Tokens/s of the DiLoCo role's inner steps (on ``local_devices`` as one peer if given)."""
    run = RunConfig(model=preset, seq_len=args.seq_len, batch_size=args.batch_size, eval_batches=0,
                    diloco=DiLoCoHyperparams(inner_steps=10**9, warmup_steps=1))
    node = NodeConfig(checkpoint_dir=os.path.join(tmp, preset), device=local_devices[0] if local_devices else
                      device.type, precision=args.precision, compile=args.compile, local_devices=local_devices,
                      micro_batch_size=args.micro_batch_size, log_every_steps=10**9)
    role = DiLoCoRole(RunContext.build("bench-gpu", run, node, Hub().transport("bench")))
    try:
        return _time_role(role, args, device)
    finally:
        if role.local_dp is not None:
            role.local_dp.close()


def _time_role(role: DiLoCoRole, args, device: torch.device) -> float:
    """Tokens/s of ``role``'s inner steps after ``args.warmup`` untimed ones (the first also joins the local
    process group when there are several devices)."""

    async def main() -> float:
        role.round_quota = args.warmup + (1 if args.compile else 0)
        await role.train_until_quota()
        sync(device)
        started = time.perf_counter()
        role.round_quota += args.steps
        await role.train_until_quota()  # reads the loss back once, at the end of the quota
        sync(device)
        return args.steps * args.batch_size * args.seq_len / (time.perf_counter() - started)

    return asyncio.run(main())


def memory_fit(preset: str, cap_gib: float, args, device: torch.device, tmp: str) -> dict:
    """One memory-fit row: what ``peerd join`` chooses at a cap of ``cap_gib`` GiB, and (on a GPU) what it uses."""
    from peerd.hardware.memory import GIB, fit_node

    run = RunConfig(model=preset, seq_len=args.seq_len, batch_size=args.batch_size, eval_batches=0,
                    diloco=DiLoCoHyperparams(inner_steps=10**9, warmup_steps=1))
    gpu = device.type == "cuda"
    if gpu and device.index is None:  # the memory-fraction and statistics calls want the card's index
        device = torch.device("cuda", torch.cuda.current_device())
    precision = args.precision if gpu or args.precision != "auto" else "bf16"  # as a GPU would resolve it
    node = NodeConfig(checkpoint_dir=os.path.join(tmp, f"fit-{preset}-{cap_gib}"), device=device.type,
                      precision=precision, log_every_steps=10**9)
    row = {"preset": preset, "cap_gib": cap_gib, "batch": args.batch_size, "seq_len": args.seq_len}
    if gpu:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total), device)
        budget = (int(cap_gib * GIB) - torch.cuda.memory_reserved(device), f"a {cap_gib:g} GiB cap")
    else:
        budget = (int(cap_gib * GIB), f"a {cap_gib:g} GiB cap (not run: no GPU)")
    try:
        fitted, line = fit_node(node, run, device if gpu else torch.device("cuda"), 256, budget=budget)
    except ValueError as e:  # ConfigError: it does not fit
        row.update(fits_predicted=False, line=str(e))
        print(f"memory {preset} @ {cap_gib:g} GiB: {e}", flush=True)
        return row
    row.update(fits_predicted=True, line=line, micro_batch=fitted.micro_batch_size,
               checkpointing=fitted.activation_checkpointing)
    from peerd.hardware.memory import Shape, estimate

    est = estimate(Shape.of(preset, 256), seq_len=args.seq_len, micro_batch_size=fitted.micro_batch_size,
                   accumulation=args.batch_size // fitted.micro_batch_size,
                   precision=resolve_precision(precision, device).name,
                   checkpointing=fitted.activation_checkpointing)
    row.update(predicted_gib=est.peak / GIB, predicted_no_reserve_gib=(est.peak - est.reserve) / GIB)
    if not gpu:
        print(f"memory {preset} @ {cap_gib:g} GiB: {line}", flush=True)
        return row
    torch.cuda.reset_peak_memory_stats(device)
    role = DiLoCoRole(RunContext.build("bench-gpu", run, fitted, Hub().transport("bench")))
    try:
        fit_args = argparse.Namespace(**{**vars(args), "steps": args.fit_steps, "warmup": 1})
        row["tokens_per_s"] = _time_role(role, fit_args, device)
        row["ran"] = True
    except torch.OutOfMemoryError:
        row["ran"] = False
    finally:
        del role
        gc.collect()  # the role's cycles hold the model: free it before the next cap
        row["measured_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    print(f"memory {preset} @ {cap_gib:g} GiB: {line}; measured peak {row['measured_gib']:.2f} GiB; "
          + (f"ran, {row['tokens_per_s']:,.0f} tok/s" if row["ran"] else "OUT OF MEMORY"), flush=True)
    return row


def fit_pairs(presets: list[str], caps: list[float]) -> list[tuple[str, float]]:
    """Every (preset, cap), each preset's own card first (the largest preset at the largest cap, the second largest
    at the second largest cap, ...: 1.1b at 24, 350m at 12, 125m at 8), so a run cut short has the rows that matter
    most."""
    order = sorted(range(len(presets)), key=lambda i: get_preset(presets[i]).parameter_count(), reverse=True)
    caps_desc = sorted(caps, reverse=True)
    own = [(presets[i], caps_desc[k]) for k, i in enumerate(order) if k < len(caps_desc)]
    return own + [(p, c) for p in presets for c in caps if (p, c) not in own]


def fit_row_in_child(preset: str, cap_gib: float, args) -> dict:
    """:func:`memory_fit` in a fresh process: each row starts from an empty GPU (no cached blocks, no memory held by
    the rows before it), so its cap and its measured peak are its own."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--fit-row", preset, str(cap_gib), "--device", args.device,
           "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--precision", args.precision,
           "--fit-steps", str(args.fit_steps)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.fit_timeout)
    except subprocess.TimeoutExpired:
        print(f"memory {preset} @ {cap_gib:g} GiB: no result within {args.fit_timeout:g} s", flush=True)
        return {"preset": preset, "cap_gib": cap_gib, "fits_predicted": None, "error": "timeout"}
    for line in done.stdout.splitlines():
        if line.startswith("FITROW "):
            print(next((x for x in done.stdout.splitlines() if x.startswith("memory ")), ""), flush=True)
            return json.loads(line[len("FITROW "):])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    print(f"memory {preset} @ {cap_gib:g} GiB: failed (exit {done.returncode}): {tail}", flush=True)
    return {"preset": preset, "cap_gib": cap_gib, "fits_predicted": None, "error": tail}


def round_boundary(preset: str, args, device: torch.device, tmp: str) -> dict:
    """The outer round's fixed costs beyond the all-reduce, in seconds, with the node's defaults (see the module
    docstring): a first boundary and a second one (steady: page-locked buffers allocated, writer idle)."""
    run = RunConfig(model=preset, seq_len=args.seq_len, batch_size=args.batch_size,
                    diloco=DiLoCoHyperparams(inner_steps=10**9, warmup_steps=1))
    node = NodeConfig(checkpoint_dir=os.path.join(tmp, f"boundary-{preset}"), device=device.type,
                      precision=args.precision, micro_batch_size=args.micro_batch_size, log_every_steps=10**9)
    role = DiLoCoRole(RunContext.build("bench-gpu", run, node, Hub().transport("bench")))
    _time_role(role, argparse.Namespace(**{**vars(args), "steps": 2, "warmup": 1}), device)  # optimizer state exists
    part = role.part
    background = {"eval": False}  # whether an evaluation ran in the background

    async def boundary() -> dict:
        times = {}

        async def timed(name, fn):
            sync(device)
            started = time.perf_counter()
            out = fn()
            if asyncio.iscoroutine(out):
                out = await out
            sync(device)
            times[name] = time.perf_counter() - started
            return out

        delta = await timed("pseudo_gradient", lambda: part.outer.pseudo_gradient(part.fragment.flatten(role.model)))
        new = await timed("outer_step", lambda: part.outer.apply(delta, role.hp))
        await timed("load_theta", lambda: part.reset_to_outer(role.model, new))
        await timed("checkpoint", role.save_checkpoint)
        await timed("eval", role.round_eval)
        times["total"] = sum(times.values())
        # what went to the background, until done (the next inner steps would run meanwhile)
        started = time.perf_counter()
        written = role.wait_for_write()
        times["checkpoint_background"] = time.perf_counter() - started if written else 0.0
        started = time.perf_counter()
        evaluated = await role.wait_for_evaluation()
        times["eval_background"] = time.perf_counter() - started if evaluated else 0.0
        started = time.perf_counter()  # hashed in a worker thread while the inner steps go on (WholeModelRounds)
        new.digest()
        times["digest_background"] = time.perf_counter() - started
        background["eval"] = background["eval"] or evaluated
        return times

    async def both() -> list[dict]:
        return [await boundary(), await boundary()]

    first, steady = asyncio.run(both())
    row = {"preset": preset, "eval_batches": run.eval_batches, "theta_outer_pinned": part.outer.theta.is_pinned(),
           "background_checkpoint": role.writer is not None, "background_eval": background["eval"],
           **{k + "_s": v for k, v in steady.items()}, "first": {k + "_s": v for k, v in first.items()}}
    for name, times in (("first", first), ("steady", steady)):
        print(f"boundary {preset} ({name}): " + ", ".join(f"{k} {v:.3f} s" for k, v in times.items())
              + f"; theta_outer pinned: {row['theta_outer_pinned']}", flush=True)
    role.save_checkpoint(final=True)
    return row


def peak_tflops(device: torch.device, override: float) -> float:
    if override:
        return override
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--presets", nargs="+", help="dense presets (default: tiny small on CPU; small 125m 350m 1.1b on "
                    "a GPU)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per side (default 30 on a GPU, 5 on CPU)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--repeats", type=int, default=2, help="measure each side this many times, interleaved, and "
                    "keep the best (default 2)")
    ap.add_argument("--batch-size", type=int, default=0, help="sequences per step (default 16 GPU, 8 CPU)")
    ap.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default 1024 GPU, 128 CPU)")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto")
    ap.add_argument("--compile", action="store_true", help="torch.compile both sides")
    ap.add_argument("--micro-batch-size", type=int, default=0, help="peerd's micro-batch (0 = whole batch)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense bf16 peak (default: table)")
    ap.add_argument("--local-devices", help="also time peerd as one peer on these devices (e.g. cuda:0,cuda:1; "
                    "cpu,cpu on a CPU) and report its speed-up over one device")
    ap.add_argument("--memory-fit", action="store_true", help="also the memory-fit rows (see above)")
    ap.add_argument("--caps", nargs="+", type=float, default=[24.0, 12.0, 8.0], help="GiB caps of --memory-fit")
    ap.add_argument("--fit-presets", nargs="+", default=["125m", "350m", "1.1b"], help="presets of --memory-fit")
    ap.add_argument("--fit-steps", type=int, default=3, help="timed inner steps per memory-fit row (default 3)")
    ap.add_argument("--fit-timeout", type=float, default=90.0, help="seconds per memory-fit row (default 90)")
    ap.add_argument("--fit-row", nargs=2, metavar=("PRESET", "CAP_GIB"), help=argparse.SUPPRESS)
    ap.add_argument("--boundary", action="store_true", help="also the round-boundary rows, per --presets")
    ap.add_argument("--only-extra", action="store_true", help="skip the throughput table (only --memory-fit and "
                    "--boundary)")
    ap.add_argument("--json", help="write every row into this JSON file")
    ap.add_argument("--md", help="write the results section into this markdown file")
    args = ap.parse_args()
    local = tuple(d.strip() for d in (args.local_devices or "").split(",") if d.strip())
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    gpu = device.type == "cuda"
    args.presets = args.presets or (["small", "125m", "350m", "1.1b"] if gpu else ["tiny", "small"])
    args.steps = args.steps or (30 if gpu else 5)
    args.batch_size = args.batch_size or (16 if gpu else 8)
    args.seq_len = args.seq_len or (1024 if gpu else 128)
    enable_tf32(device)
    peak = peak_tflops(device, args.peak_tflops)
    where = torch.cuda.get_device_name(device) if gpu else "CPU (no GPU here: small presets only, no MFU)"
    print(f"device: {where}; precision {resolve_precision(args.precision, device).name}; batch {args.batch_size} x "
          f"{args.seq_len} tokens; {args.steps} timed steps", flush=True)
    rows, fits, boundaries = [], [], []
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if args.fit_row:
            print("FITROW " + json.dumps(memory_fit(args.fit_row[0], float(args.fit_row[1]), args, device, tmp)))
            return 0
        if args.memory_fit:
            for preset, cap in fit_pairs(args.fit_presets, args.caps):
                fits.append(fit_row_in_child(preset, cap, args))
                if args.json:  # row by row: a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump({"device": where, "argv": sys.argv[1:], "memory_fit": fits, "partial": True}, f,
                                  indent=1)
        if args.boundary:
            for preset in args.presets:
                try:
                    boundaries.append(round_boundary(preset, args, device, tmp))
                except torch.OutOfMemoryError:
                    print(f"boundary {preset}: out of memory", flush=True)
                if gpu:
                    torch.cuda.empty_cache()
        for preset in ([] if args.only_extra else args.presets):
            try:
                if gpu:
                    torch.cuda.empty_cache()
                plain = ours = several = 0.0
                for _ in range(args.repeats):  # interleaved, best of each: a noisy machine slows both alike
                    plain = max(plain, plain_loop(preset, args, device))
                    ours = max(ours, peerd_role(preset, args, device, tmp))
                    if local:
                        several = max(several, peerd_role(preset, args, device, tmp, local))
            except torch.OutOfMemoryError:
                print(f"{preset}: out of memory at batch {args.batch_size}; try --micro-batch-size", flush=True)
                rows.append((preset, None, None, None, None, None))
                continue
            fpt = flops_per_token(preset, args.seq_len)
            mfu = (ours * fpt / (peak * 1e12)) if peak else None
            plain_mfu = (plain * fpt / (peak * 1e12)) if peak else None
            rows.append((preset, ours, plain, mfu, plain_mfu, several))
            print(f"{preset}: peerd {ours:,.0f} tok/s, plain loop {plain:,.0f} tok/s ({ours / plain:.3f})"
                  + (f", MFU {mfu:.1%} vs {plain_mfu:.1%}" if mfu is not None else "")
                  + (f"; peerd on {len(local)} devices {several:,.0f} tok/s ({several / ours:.2f}x one device)"
                     if local else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "machine": machine_line(), "argv": sys.argv[1:], "throughput": [
                dict(zip(("preset", "peerd", "plain", "mfu", "plain_mfu", "local_devices"), r)) for r in rows],
                "memory_fit": fits, "boundary": boundaries}, f, indent=1)
    command = f"Command: `python scripts/bench_gpu.py {' '.join(result_args(sys.argv[1:]))}`"
    if args.md and fits:
        lines = [FIT_HEADING, "", command, "", f"Machine: {machine_line()}; device {where}.", "",
                 "| preset | cap GiB | micro-batch x seq | checkpointing | predicted peak GiB (w/o reserve) | "
                 "measured peak GiB | ran | tok/s |", "|---|---:|---|---|---:|---:|---|---:|"]
        for r in fits:
            if r["fits_predicted"] is None:
                lines.append(f"| {r['preset']} | {r['cap_gib']:g} | no result: {r['error']} | | | | | |")
                continue
            if not r["fits_predicted"]:
                lines.append(f"| {r['preset']} | {r['cap_gib']:g} | refused: does not fit | | | | | |")
                continue
            lines.append(f"| {r['preset']} | {r['cap_gib']:g} | {r['micro_batch']} x {r['seq_len']} | "
                         f"{'on' if r['checkpointing'] else 'off'} | {r['predicted_gib']:.2f} "
                         f"({r['predicted_no_reserve_gib']:.2f}) | "
                         + (f"{r['measured_gib']:.2f} | {'yes' if r['ran'] else 'OOM'} | "
                            f"{r.get('tokens_per_s', 0):,.0f} |" if "ran" in r else "n/a | not run | |"))
        replace_section(args.md, FIT_HEADING, "\n".join(lines) + "\n")
    if args.md and boundaries:
        keys = ("pseudo_gradient", "outer_step", "load_theta", "checkpoint", "eval", "total", "checkpoint_background",
                "eval_background", "digest_background")
        lines = [BOUNDARY_HEADING, "", command, "", f"Machine: {machine_line()}; device {where}.", "",
                 "| preset | " + " | ".join(f"{k} s" for k in keys) + " |", "|---|" + "---:|" * len(keys)]
        lines += [f"| {r['preset']} | " + " | ".join(f"{r[k + '_s']:.3f}" for k in keys) + " |" for r in boundaries]
        lines += ["", "First boundary's total (page-locked buffers allocated then): "
                  + ", ".join(f"{r['preset']} {r['first']['total_s']:.3f} s" for r in boundaries) + "."]
        replace_section(args.md, BOUNDARY_HEADING, "\n".join(lines) + "\n")
    if args.md and rows:
        lines = [HEADING, "", f"Command: `python scripts/bench_gpu.py {' '.join(result_args(sys.argv[1:]))}`", "",
                 f"Machine: {machine_line()}; device {where}; peak {peak or 'n/a'} TFLOP/s.", "",
                 "| preset | peerd tok/s | plain loop tok/s | peerd / plain | MFU peerd | MFU plain |"
                 + (f" peerd on {', '.join(local)} tok/s | x one device |" if local else ""),
                 "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if local else "")]
        for preset, ours, plain, mfu, plain_mfu, several in rows:
            if ours is None:
                lines.append(f"| {preset} | OOM | | | | |" + (" | |" if local else ""))
                continue
            pct = (lambda v: f"{v:.1%}" if v is not None else "n/a")
            lines.append(f"| {preset} | {ours:,.0f} | {plain:,.0f} | {ours / plain:.3f} | {pct(mfu)} | "
                         f"{pct(plain_mfu)} |" + (f" {several:,.0f} | {several / ours:.2f} |" if local else ""))
        replace_section(args.md, HEADING, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
