"""A swarm of real peers on one machine: each peer its own ``peerd`` process on 127.0.0.1 (or, for averaging-only
peers, many light peers per process: :meth:`Swarm.start_light_peers`).

Used by the integration tests, the local demo and the benchmarks: start a bootstrap node and workers, read their
JSON log events, stop them, and always clean up whole process trees (a worker's DHT child and p2pd included).
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "node_configs" / "machines" / "local-test.toml"
TINY = ROOT / "node_configs" / "runs" / "tiny-test.toml"


def peerd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "peerd", *args]


@dataclass
class Peer:
    name: str
    proc: subprocess.Popen
    log: Path
    _seen: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    def poll_events(self) -> list[dict[str, Any]]:
        """Parse new JSON log lines; returns all events so far."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        lines = text.splitlines()
        complete = lines if text.endswith("\n") else lines[:-1]
        for line in complete[self._seen:]:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                self.events.append(record)
        self._seen = len(complete)
        return self.events

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.poll_events() if e.get("event") == event]

    def digests(self) -> dict[int, str]:
        """outer round -> theta_outer digest, from completed rounds and state downloads."""
        out = {e["outer_round"]: e["digest"] for e in self.of("state_download")}
        out.update({e["outer_round"]: e["digest"] for e in self.of("outer_round")})
        return out


class Swarm:
    """A bootstrap node plus workers, each its own process tree; :meth:`close` kills everything.

    ``preload=True``: workers are forked from a process that already imported peerd, torch and hivemind
    (:func:`start_preloaded`) instead of each starting a fresh interpreter: the same ``peerd join`` in its own
    process, with the imported modules' memory shared copy-on-write (tiny model, 16 workers: 277 MB per worker
    instead of 444 with ``--dht inline``, docs/benchmarks.md), so that tens of workers fit on one machine."""

    def __init__(self, workdir: Path, preload: bool = False):
        self.workdir = workdir
        self.peers: list[Peer] = []
        self.bootstrap_maddr: Optional[str] = None
        self._bootstrap: Optional[subprocess.Popen] = None
        self.children = ProcessSet()
        self.preload = preload

    def start_bootstrap(self, timeout_s: float = 90.0, *extra: str, env: Optional[dict] = None) -> str:
        """Start ``peerd bootstrap`` (extra flags appended, ``env`` entries added); returns its multiaddr."""
        out = self.workdir / "bootstrap.out"
        with open(out, "w") as stdout, open(self.workdir / "bootstrap.err", "w") as stderr:
            self._bootstrap = self.children.start(
                peerd_cmd("bootstrap", "--config", str(LOCAL), "--identity", str(self.workdir / "bootstrap.key"),
                          "--checkpoint-dir", str(self.workdir / "bootstrap-state"), *extra),
                stdout=stdout, stderr=stderr, env={**os.environ, **(env or {})},
            )
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            lines = [l for l in out.read_text().splitlines() if "/p2p/" in l]
            if lines:
                self.bootstrap_maddr = lines[0].strip()
                return self.bootstrap_maddr
            if self._bootstrap.poll() is not None:
                raise RuntimeError(f"bootstrap exited: {(self.workdir / 'bootstrap.err').read_text()[-2000:]}")
            time.sleep(0.1)
        raise TimeoutError("bootstrap node did not print its multiaddrs")

    def start_peer(
        self, name: str, run_id: str, run_config: Optional[Path] = TINY, *extra: str, env: Optional[dict] = None
    ) -> Peer:
        """Start ``peerd join`` with its own identity and checkpoint folder; extra flags are appended, ``env``
        entries are added to the environment (e.g. ``PEERD_FAULTS``)."""
        args = ["join", "--run-id", run_id, "--config", str(LOCAL), "--log-format", "json",
                "--identity", str(self.workdir / f"{name}.key"), "--checkpoint-dir", str(self.workdir / f"ckpt-{name}")]
        if self.bootstrap_maddr:
            args += ["--initial-peers", self.bootstrap_maddr]
        if run_config is not None:
            args += ["--run-config", str(run_config)]
        log = self.workdir / f"{name}.log"
        if log.exists():
            # a restart under the same name: the previous log moves aside, so that a child the killed daemon left
            # behind (still writing to that file until it notices) cannot scramble the new process's log
            log.rename(log.with_name(f"{name}.{len(list(self.workdir.glob(f'{name}.*.log'))) + 1}.log"))
        env = {"PEERD_LOGLEVEL": "INFO", **(env or {})}
        if self.preload:
            proc: Any = start_preloaded([*args, *extra], log, env)
            self.children.procs.append(proc)
        else:
            with open(log, "w") as stderr:
                proc = self.children.start(peerd_cmd(*args, *extra), stdout=subprocess.DEVNULL, stderr=stderr,
                                           env={**os.environ, **env})
        peer = Peer(name, proc, log)
        self.peers.append(peer)
        return peer

    def start_process(self, name: str, argv: list[str]) -> Peer:
        """Start any command as a managed peer process (stderr to ``<name>.log``); killed by :meth:`close`."""
        log = self.workdir / f"{name}.log"
        with open(log, "w") as stderr:
            proc = self.children.start(argv, stdout=subprocess.DEVNULL, stderr=stderr)
        peer = Peer(name, proc, log)
        self.peers.append(peer)
        return peer

    def start_light_peers(self, n: int, out_template: str, *flags: str, per_process: int = 8) -> list[Peer]:
        """Start ``n`` averaging peers (``peerd.testing.avgpeer``) as light peers, ``per_process`` to a process (each
        peer its own p2pd and in-process DHT node), bootstrapped from this swarm's bootstrap node. ``out_template``
        contains ``{index}``; ``flags`` are passed on (``--topology``, ``--rounds``...). Returns the processes."""
        if "{index}" not in out_template:
            raise ValueError("out_template must contain {index}")
        procs = []
        for first in range(0, n, per_process):
            argv = [sys.executable, "-m", "peerd.testing.avgpeer", "--index", str(first),
                    "--peers", str(min(per_process, n - first)), "--expect", str(n), "--out", out_template, *flags]
            if self.bootstrap_maddr:
                argv += ["--initial-peers", self.bootstrap_maddr]
            procs.append(self.start_process(f"light{first}", argv))
        return procs

    def wait_for(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if condition():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; logs:\n{self.tails()}")

    def wait_exit(self, peer: Peer, timeout_s: float) -> int:
        try:
            return peer.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{peer.name} did not exit within {timeout_s} s; logs:\n{self.tails()}") from None

    def tails(self, chars: int = 1500) -> str:
        return "\n".join(f"--- {p.name} (rc={p.proc.poll()})\n{p.log.read_text(errors='replace')[-chars:]}"
                         for p in self.peers)

    def close(self) -> None:
        self.children.stop(grace_s=0.0)


#: What the preloading parent imports before it forks workers (``torch._dynamo``: torch's optimizers import it on
#: first use, ~100 MB).
PRELOAD = ("torch", "torch._dynamo", "hivemind", "peerd.commands.main", "peerd.daemon", "peerd.roles.diloco")


class PreloadedProcess:
    """A ``peerd`` process forked from the preloading parent, with the part of ``subprocess.Popen``'s interface the
    swarm uses (``pid``, ``poll``, ``wait``, ``returncode``)."""

    def __init__(self, process: Any):
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["peerd"], timeout or 0.0)
        return self._process.exitcode


def _preload_context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def warm_preload() -> None:
    """Start the fork server and wait until it imported :data:`PRELOAD` (seconds; the first
    :func:`start_preloaded` call otherwise pays for it), so that later starts take well under a second."""
    process = _preload_context().Process(target=int, daemon=True)
    process.start()
    process.join()


def start_preloaded(argv: list[str], log: Path, env: dict[str, str]) -> PreloadedProcess:
    """``peerd <argv>`` in a process forked from multiprocessing's fork server, which imported :data:`PRELOAD`
    once (started on first use, one per launching process): stderr to ``log``, stdout to /dev/null, ``env`` added
    to the environment, leading its own session like :meth:`ProcessSet.start`'s processes. Modules that read the
    environment at import time see the launcher's environment, not ``env``."""
    process = _preload_context().Process(target=_preloaded_main, args=(argv, str(log), env), daemon=False)
    process.start()
    return PreloadedProcess(process)


def _preloaded_main(argv: list[str], log: str, env: dict[str, str]) -> None:
    """In the forked process: detach, redirect, run the CLI, exit with its code."""
    gc.freeze()  # objects inherited from the parent: the collector no longer writes to (and so copies) their pages
    os.setsid()
    with open(log, "w") as stderr, open(os.devnull, "w") as devnull:
        os.dup2(stderr.fileno(), 2)
        os.dup2(devnull.fileno(), 1)
    os.environ.update(env)
    from peerd.commands.main import main

    sys.exit(main(argv))


class ProcessSet:
    """Child processes for local swarms, each leading its own session (process group), so that a peer's helpers
    (its DHT child, p2pd) can be reached even after their parent died. Used by the tests, the demo and every
    benchmark; :meth:`stop` always leaves nothing behind."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen(argv, start_new_session=True, **popen_kwargs)``, remembered for :meth:`stop`."""
        proc = subprocess.Popen(argv, start_new_session=True, **popen_kwargs)
        self.procs.append(proc)
        return proc

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group (a clean stop: checkpoint, leave), then SIGKILL each whole tree and group
        still there after ``grace_s`` seconds (0: kill at once)."""
        if grace_s > 0:
            for proc in self.procs:
                signal_group(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in self.procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for proc in self.procs:
            kill_tree(proc.pid)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()


def signal_group(pid: int, sig: int) -> None:
    """Signal the process group led by ``pid``; a group outlives its leader while helpers remain."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, every descendant, and the process group it leads (which also reaches orphans whose parent
    was killed first)."""
    try:
        parent = psutil.Process(pid)
        family = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        family = []
    for proc in family:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    signal_group(pid, signal.SIGKILL)


def pump_lines(stream: Any, log_path: str | os.PathLike, on_line: Callable[[str], None]) -> threading.Thread:
    """Copy a child's text ``stream`` line by line into ``log_path`` (flushed per line) and hand each line to
    ``on_line``, in a daemon thread."""

    def run() -> None:
        with open(log_path, "w") as log:
            for line in iter(stream.readline, ""):
                log.write(line)
                log.flush()
                on_line(line)
        stream.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
