"""How peerd's processes stop: on SIGINT/SIGTERM, helpers out of reach of the terminal's signals, bounded stops of
helper process trees, and the immediate exit on a second signal.

A long-running command (``join``, ``bootstrap``, ``dashboard``) stops cleanly on the first SIGINT or SIGTERM
(:func:`install_stop_handlers`: it checkpoints and leaves; a start-up still waiting on the network is abandoned,
:func:`unless_stopped`) and exits 0; a command that waits for an answer (``status``, ``doctor``, ``eval``,
``generate``) is cancelled (:func:`interruptible`) and exits 128 + the signal's number (130 for SIGINT, 143 for
SIGTERM); a second signal exits at once with that code (:func:`exit_now`). The same signal again within
:data:`REPEAT_WINDOW_S` of the first is that first one delivered twice, not a second: GNU ``timeout`` signals its
child and then its whole process group, milliseconds apart.

A terminal's Ctrl-C sends SIGINT to its whole foreground process group; ``timeout``, ``kill -- -PGID`` and some
supervisors send SIGTERM to a whole group. The daemon's helpers (hivemind's DHT process, p2pd, the py-libp2p daemon,
the watchdog of an inline p2pd) must not get those signals: each reacts in its own way (p2pd exits at once, so the
daemon could no longer leave its run; hivemind's DHT process ignores SIGINT and, forked from the daemon, inherits a
SIGTERM handler that does nothing), and multiprocessing's exit handler then waits forever for a DHT process that
will not go. So every helper runs in a session of its own (:func:`leave_terminal_session`,
:func:`in_own_session`), only the daemon decides when it stops (:func:`stop_processes`: bounded, then SIGKILL), and
each helper still dies with the daemon however the daemon dies (its own watch of its parent: the DHT process's
thread, the py-libp2p daemon's stdin, the inline p2pd's watchdog).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Awaitable, Iterable, Optional, TypeVar

import psutil

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Signals that stop a peerd command: the first asks for a clean stop, a second one exits at once.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: Seconds after the first stop signal in which the same signal again is that stop delivered twice (``timeout``
#: sends SIGTERM to its child, then to its whole group, which holds the child too), not a second request.
REPEAT_WINDOW_S = 1.0


class _StopSignals:
    """The stop signals one command has received: tells the first, a repeat of it (ignored) and a second one."""

    def __init__(self) -> None:
        self._first: Optional[tuple[int, float]] = None

    def classify(self, signum: int) -> str:
        """``"first"``, ``"repeat"`` (the first signal again within :data:`REPEAT_WINDOW_S`) or ``"second"``."""
        now = time.monotonic()
        if self._first is None:
            self._first = (signum, now)
            return "first"
        first_signum, first_at = self._first
        if signum == first_signum and now - first_at < REPEAT_WINDOW_S:
            logger.debug("%s again %.3f s after the first: the same stop delivered twice",
                         signal.Signals(signum).name, now - first_at)
            return "repeat"
        return "second"


#: Run ``argv[1:]`` in a new session (same pid: exec, no fork). ``-S``: no site import, a few ms of start-up.
_SETSID_EXEC = "import os, sys; os.setsid(); os.execv(sys.argv[1], sys.argv[1:])"


def in_own_session(argv: list[str]) -> list[str]:
    """``argv`` prefixed so that the program runs in a session of its own (out of reach of signals sent to this
    process's group), with the pid the caller spawned: for helpers started by code that takes only a command line
    (hivemind's p2pd)."""
    return [sys.executable, "-S", "-c", _SETSID_EXEC, *argv]


def leave_terminal_session() -> None:
    """In a freshly forked helper (whose parent blocked :data:`STOP_SIGNALS` around the fork,
    :func:`blocked_stop_signals`): move into a session of its own, stop writing the parent's signal wake-up fd
    (inherited through fork: every signal the helper got would reach the parent's event loop as its own), and let
    SIGTERM kill again (the inherited handler did nothing). A stop signal sent to the old group before the move is
    dropped; SIGINT stays ignored (hivemind's DHT process ignores it anyway)."""
    with contextlib.suppress(OSError):  # already a group leader: not forked by peerd
        os.setsid()
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # drops a pending SIGTERM from the old group
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def blocked_stop_signals():
    """Block :data:`STOP_SIGNALS` in this thread for the duration (around a fork: the child starts with them
    blocked until :func:`leave_terminal_session`; this process's other threads still take them)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def tree_of(pid: int) -> list[psutil.Process]:
    """Process ``pid`` and its descendants ([] if it is gone). Collect it before stopping the root: orphans are
    reparented and can no longer be found from it."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def stop_processes(procs: Iterable[psutil.Process], grace_s: float) -> list[psutil.Process]:
    """Wait up to ``grace_s`` seconds for ``procs`` to exit, SIGKILL those left, and wait up to 5 s more for them.
    Returns the ones still there after that (only a process stuck in the kernel)."""
    procs = list(procs)
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, grace_s))
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _, alive = psutil.wait_procs(alive, timeout=5.0)
    return alive


def exit_now(signum: int) -> None:
    """The second stop signal: SIGKILL every descendant (helpers must not outlive us), say so in one line, and exit
    with 128 + ``signum`` (130 for SIGINT) without unwinding: no traceback, no exit handlers. Checkpoints are written
    atomically (:mod:`peerd.worker.checkpoint_file`), so the last complete one stays valid."""
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                proc.kill()
    with contextlib.suppress(OSError, ValueError):  # no stderr to write to; a signal number Python does not name
        os.write(2, f"peerd: {signal.Signals(signum).name} again: exiting now\n".encode())
    os._exit(128 + signum)


class Interrupted(BaseException):
    """A command was stopped by signal ``signum`` before it was done (exit code 128 + ``signum``). A BaseException,
    like KeyboardInterrupt: a handler of runtime failures (``except Exception``) must not report it as one."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def install_stop_handlers(stop: asyncio.Event, leaving: str = "finishing up (checkpoint, then leave)") -> None:
    """SIGINT/SIGTERM set ``stop`` and log ``leaving`` (what this daemon does now: a worker checkpoints, then leaves);
    a second one exits at once (:func:`exit_now`), the same signal again within :data:`REPEAT_WINDOW_S` excepted."""
    loop = asyncio.get_running_loop()
    signals = _StopSignals()

    def on_signal(signum: int) -> None:
        kind = signals.classify(signum)
        if kind == "repeat":
            return
        if kind == "second" or stop.is_set():  # set without a signal: the daemon is already leaving
            exit_now(signum)
        logger.info("received %s: %s; the same signal again exits at once", signal.Signals(signum).name, leaving)
        stop.set()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)


async def unless_stopped(stop: asyncio.Event, work: Awaitable[T]) -> Optional[T]:
    """``await work``, unless ``stop`` is set first: then ``work`` is cancelled (and cleans up after itself) and
    this returns None. For start-ups that may wait long on the network (a bootstrap node that does not answer)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if stop.is_set() and not _cancelling():
            return None
        raise


def _cancelling() -> bool:
    """Whether the current task itself is being cancelled (not only the work it waited on)."""
    current = asyncio.current_task()
    return current is not None and current.cancelling() > 0


async def interruptible(work: Awaitable[T]) -> T:
    """``await work``; the first SIGINT/SIGTERM cancels it (its clean-up runs: finally blocks, bounded transport
    shutdowns) and raises :class:`Interrupted`; a second one exits at once (:func:`exit_now`), the same signal again
    within :data:`REPEAT_WINDOW_S` excepted. Outside the main
    thread (where signal handlers cannot be installed) it is a plain ``await``."""
    task = asyncio.ensure_future(work)
    if threading.current_thread() is not threading.main_thread():
        return await task
    loop = asyncio.get_running_loop()
    received: list[int] = []
    signals = _StopSignals()

    def on_signal(signum: int) -> None:
        kind = signals.classify(signum)
        if kind == "repeat":
            return
        if kind == "second":
            exit_now(signum)
        received.append(signum)
        task.cancel()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return await task
    except asyncio.CancelledError:
        if received:
            raise Interrupted(received[0]) from None
        raise
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)


async def reap(*tasks: Optional[asyncio.Future], cancel: bool = True) -> None:
    """Wait until each of ``tasks`` has ended (None entries skipped), cancelling it first unless ``cancel`` is False:
    how an owner that stops ends its background tasks (a status loop, a background evaluation, abandoned work).
    How a task ended does not propagate: a failure is logged here (a warning with its traceback), a cancellation is
    the expected end. The caller's own cancellation does propagate."""
    pending = [task for task in tasks if task is not None]
    if cancel:
        for task in pending:
            task.cancel()
    if pending:
        await asyncio.wait(pending)
    for task in pending:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("background task failed: %r", task, exc_info=task.exception())


async def stop_all(components: Iterable[Any]) -> None:
    """``await component.stop()`` for each of ``components``, in order, for leaving: one that fails to stop is
    logged (debug) and the rest are stopped all the same (the transport goes down next anyway)."""
    for component in components:
        try:
            await component.stop()
        except Exception:  # boundary: leaving; one service that fails to stop must not keep the others serving
            logger.debug("could not stop %r", component, exc_info=True)
