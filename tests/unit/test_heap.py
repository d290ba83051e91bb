"""Returning freed heap memory to the OS between outer rounds (peerd.runtime.heap)."""

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
