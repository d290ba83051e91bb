"""The process heap (peerd.runtime.heap): freed memory back to the OS between outer rounds, the long-lived heap out
of the garbage collector's walk."""

import gc
import weakref

import psutil
import pytest

from peerd.runtime import heap

pytestmark = pytest.mark.timeout(60)


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 1e6


def test_trim_heap_gives_the_holes_freed_blocks_leave_back_to_the_os(monkeypatch):
    """4,000 blocks of 32 KiB (heap, not mmap), every other one freed: glibc keeps the ~64 MB of holes resident until
    malloc_trim; with PEERD_TRIM_HEAP=0 nothing is trimmed."""
    blocks = [bytearray(32 * 1024) for _ in range(4000)]
    for b in blocks:
        b[::4096] = b"\x01" * len(b[::4096])  # touch every page: resident
    del blocks[::2]
    monkeypatch.setenv(heap.TRIM_ENV, "0")
    assert heap.trim_heap() is False
    monkeypatch.delenv(heap.TRIM_ENV)
    if heap._malloc_trim() is None:  # a C library without malloc_trim: a no-op, never an error
        assert heap.trim_heap() is False
        return
    before = _rss_mb()
    assert heap.trim_heap() is True
    assert before - _rss_mb() > 20, (before, _rss_mb())
    assert len(blocks) == 2000


class _Node:
    def __init__(self):
        self.other = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_heap_collects_the_garbage_there_is_then_freezes_what_lives(monkeypatch):
    """Garbage in a reference cycle is collected first (frozen, it would never be); a live object lands in the
    collector's permanent generation, out of every later collection's walk; PEERD_FREEZE_HEAP=0 does nothing."""
    gc.disable()  # no automatic collection between the steps below
    live, dead = _Node(), _Node()
    gone = weakref.ref(dead)
    del dead
    try:
        monkeypatch.setenv(heap.FREEZE_ENV, "0")
        assert heap.freeze_heap() == 0
        assert gone() is not None and gc.get_freeze_count() == 0
        monkeypatch.delenv(heap.FREEZE_ENV)
        frozen = heap.freeze_heap()
        assert gone() is None
        # frozen objects that die leave the permanent generation: another thread (of an earlier test) may free some
        assert frozen > 0 and 0 < gc.get_freeze_count() <= frozen
        assert not any(o is live for o in gc.get_objects())  # tracked objects outside the permanent generation
    finally:
        gc.unfreeze()
        gc.enable()
    assert any(o is live for o in gc.get_objects())
