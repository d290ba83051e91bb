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

Usage: python scripts/bench_gpu.py [--device cuda] [--presets small 125m ...] [--steps 30] [--batch-size 16]
       [--seq-len 1024] [--precision auto] [--compile] [--micro-batch-size M] [--local-devices cuda:0,cuda:1]
       [--md docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchlib import machine_line, replace_section, result_args  # noqa: E402
from peerd.config import NodeConfig  # noqa: E402
from peerd.inner_step import enable_tf32, resolve_precision  # noqa: E402
from peerd.models import build_model, get_preset  # noqa: E402
from peerd.roles.base import RunContext  # noqa: E402
from peerd.roles.diloco import DiLoCoRole  # noqa: E402
from peerd.run_config import RunConfig  # noqa: E402
from peerd.transport.inprocess import Hub  # noqa: E402
from protocols.diloco import DiLoCoHyperparams, make_inner_optimizer  # noqa: E402

HEADING = "## GPU use: a peer's inner steps vs a plain PyTorch loop"
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
    rows = []
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
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
    if args.md:
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
