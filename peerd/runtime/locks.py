"""Exclusive per-daemon locks on state files (the identity key, the control socket): ``flock`` on a ``.lock`` file.

A lock file holds the pid of the daemon that holds it, so a refused daemon can say which process is in its way.
The kernel drops the lock when its holder dies, however it dies, so a lock never outlives its daemon. Forked children
(hivemind's DHT process) inherit the locked descriptor, and a flock stays held while any copy of it is open: each
child closes its copies right after the fork, so an orphaned child can never keep a dead daemon's lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Optional

_held: set[int] = set()


def _close_in_child() -> None:
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class LockHeld(RuntimeError):
    """Another live process holds the lock; ``pid`` is its pid (None if it has not written it yet)."""

    def __init__(self, path: Path, pid: Optional[int]):
        super().__init__(f"{path} is held by pid {pid if pid is not None else '(unknown)'}")
        self.path = path
        self.pid = pid


def acquire(path: str | os.PathLike) -> int:
    """Take the exclusive lock ``path`` (created with mode 0600; its folder must exist) and write our pid into it.

    Returns the lock's file descriptor, for :func:`release`. Raises LockHeld if another process holds it, OSError if
    the file cannot be opened."""
    path = Path(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockHeld(path, holder(path)) from None
    _held.add(fd)
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release(fd: Optional[int]) -> None:
    """Drop a lock taken with :func:`acquire`. The file stays: unlinking it would let two daemons lock two files."""
    if fd is None:
        return
    _held.discard(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


def holder(path: str | os.PathLike) -> Optional[int]:
    """The pid written in the lock file ``path``, or None if it is missing or unreadable."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path(path).read_text().strip())
    return None
