#!/usr/bin/env python3
"""Host memory and time of writing and reading a DiLoCo checkpoint of a preset's size, against safetensors'
in-memory ``save``/``load`` (what peerd's checkpoint file used before) in the same run.

A DiLoCo worker's checkpoint holds five fp32 vectors of P values (theta_outer, the outer momentum, theta_local and
AdamW's two moments): 20P bytes, 22 GB for the 1.1b preset. Each measurement runs in a fresh interpreter: it builds
the tensors (or nothing, to read), then writes them with :func:`peerd.worker.checkpoint_file.save_checkpoint` or
reads them with :func:`peerd.worker.checkpoint_file.load_checkpoint` (the baseline: ``safetensors.torch.save`` into
one ``bytes`` written to the file; the whole file read into memory, then ``safetensors.torch.load``). Reported: the
process's peak resident memory (``ru_maxrss``, exact) above its resident memory before the operation, and the wall
time (writes include ``fsync``; reads come from the page cache, the file having just been written, and touch every
value: peerd's loaded tensors map the file, their pages come in as they are used).

``.venv/bin/python scripts/bench_checkpoint_memory.py --presets small 125m --md docs/benchmarks.md``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import machine_line, replace_section, result_args  # noqa: E402

HEADING = "## Checkpoint host memory (scripts/bench_checkpoint_memory.py)"
NAMES = ("theta_outer", "momentum", "theta_local", "inner.0.exp_avg", "inner.0.exp_avg_sq")
MODES = ("write, baseline", "write, peerd", "read, baseline", "read, peerd")


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def one(mode: str, params: int, path: str) -> dict:
    """Run one measurement in this interpreter: ``{"extra_bytes": peak above before, "seconds": ...}``."""
    import torch
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from peerd.worker.checkpoint_file import Checkpoint, load_checkpoint, save_checkpoint

    tensors = {name: torch.randn(params) for name in NAMES} if mode.startswith("write") else None
    before = rss_bytes()
    started = time.perf_counter()
    if mode == "write, peerd":
        save_checkpoint(path, Checkpoint(tensors, {"outer_round": 1}))
    elif mode == "write, baseline":
        blob = st_save(tensors, metadata={"peerd": json.dumps({"outer_round": 1})})
        with open(path, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        del blob
    elif mode == "read, peerd":
        got = load_checkpoint(path).tensors
    else:
        with open(path, "rb") as f:
            blob = f.read()
        got = st_load(blob)
        del blob
    if mode.startswith("read"):  # every value read (peerd's tensors map the file: pages come in as they are used)
        sum(float(t.sum()) for t in got.values())
    seconds = time.perf_counter() - started
    if mode.startswith("read"):
        assert sorted(got) == sorted(NAMES) and all(t.numel() == params for t in got.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"extra_bytes": peak - before, "seconds": seconds}


def measure(params: int) -> dict[str, dict]:
    """Each mode of :data:`MODES` in a fresh interpreter, reads after the writes of the same file."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_memory_") as tmp:
        path = os.path.join(tmp, "state.safetensors")
        for mode in MODES:
            done = subprocess.run([sys.executable, __file__, "--one", mode, "--params", str(params), "--path", path],
                                  check=True, capture_output=True, text=True)
            out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def report(results: dict[str, tuple[int, dict]], args: argparse.Namespace) -> str:
    lines = [
        HEADING, "",
        "Command: `.venv/bin/python scripts/bench_checkpoint_memory.py " + " ".join(result_args(sys.argv[1:])) + "`  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}  ",
        f"Machine: {machine_line()}.", "",
        "A DiLoCo checkpoint of P parameters (five fp32 vectors of P: 20P bytes); extra host memory = the process's "
        "peak resident memory above its resident memory before the write (the tensors already built) or the read "
        "(every value touched after it); "
        "baseline = safetensors' in-memory `save`/`load` (peerd's checkpoint file before), same run.", "",
        "| preset | P | checkpoint | operation | baseline extra | peerd extra | ratio | baseline s | peerd s |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for preset, (params, modes) in results.items():
        for op in ("write", "read"):
            base, ours = modes[f"{op}, baseline"], modes[f"{op}, peerd"]
            ratio = ours["extra_bytes"] / base["extra_bytes"] if base["extra_bytes"] > 0 else float("nan")
            lines.append(f"| {preset} | {params / 1e6:.0f}M | {20 * params / 1e9:.2f} GB | {op} | "
                         f"{base['extra_bytes'] / 1e9:.2f} GB | {ours['extra_bytes'] / 1e9:.2f} GB | {ratio:.2f} | "
                         f"{base['seconds']:.1f} | {ours['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["small", "125m"], help="model presets whose P to checkpoint")
    p.add_argument("--md", default=None, help="replace this section in that markdown file")
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--params", type=int, help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.params, args.path)))
        return
    from peerd.hardware.memory import Shape
    from peerd.models.registry import BYTE_VOCAB

    results = {}
    for preset in args.presets:
        params = Shape.of(preset, BYTE_VOCAB).parameters
        results[preset] = (params, measure(params))
    section = report(results, args)
    print(section)
    if args.md:
        replace_section(args.md, HEADING, section)


if __name__ == "__main__":
    main()
