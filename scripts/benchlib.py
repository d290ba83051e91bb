"""What the benchmark scripts share: loading the WAN testbed, describing the machine and the command, and writing
their section of docs/benchmarks.md. Imported by scripts/bench_*.py (the scripts' folder is on sys.path when they
run)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import platform
import sys
from types import ModuleType

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_wan_testbed() -> ModuleType:
    """scripts/wan_testbed (a script without a .py suffix) as the module ``wan_testbed``."""
    path = os.path.join(REPO, "scripts", "wan_testbed")
    loader = importlib.machinery.SourceFileLoader("wan_testbed", path)
    spec = importlib.util.spec_from_loader("wan_testbed", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["wan_testbed"] = module
    loader.exec_module(module)
    return module


def result_args(argv: list[str]) -> list[str]:
    """The command-line arguments that shape the results (where the report or the JSON is written does not)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in ("--md", "--json"):
            skip = True
        elif x != "--no-md" and not x.startswith(("--md=", "--json=")):
            out.append(x)
    return out


def machine_line() -> str:
    """One line for the report: cores, CPU model, OS, Python, torch, and the load average at start."""
    import torch

    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()
    return (f"`nproc` = {os.cpu_count()}, {cpu}, {platform.system()} {platform.machine()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}; load average at start {load[0]:.1f} "
            "(the machine is shared with other work)")


#: Ends what a benchmark writes into its section of docs/benchmarks.md: the notes and dated subsections written by
#: hand after this line stay where they are when the benchmark writes its section again.
GENERATED_END = "<!-- end of the benchmark's own output: what follows is written by hand and kept on re-runs -->"


def replace_section(md_path: str, heading: str, section: str) -> None:
    """Write ``section`` (starting with the line ``heading``) into ``md_path``, followed by :data:`GENERATED_END`.
    It replaces what the last run wrote there: from ``heading`` to that marker where the section has one, else up to
    the next ``## `` heading; text after the marker is kept. Appended at the end where ``heading`` is not there."""
    text = open(md_path).read() if os.path.exists(md_path) else "# Benchmarks\n"
    lines = text.splitlines()
    written = section.rstrip("\n").splitlines() + ["", GENERATED_END]
    try:
        start = lines.index(heading)
    except ValueError:
        new = text.rstrip("\n") + "\n\n" + "\n".join(written) + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        marker = next((i for i in range(start + 1, end) if lines[i] == GENERATED_END), None)
        if marker is not None:
            new_lines = lines[:start] + written + lines[marker + 1:]
        else:
            tail = lines[end:]
            new_lines = lines[:start] + written + ([""] + tail if tail else [])
        new = "\n".join(new_lines) + "\n"
    with open(md_path, "w") as f:
        f.write(new)


def read_events(path: str) -> list[dict]:
    """The JSON events of a daemon's log written with ``--log-format json`` (other lines skipped)."""
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out
