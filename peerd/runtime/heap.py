"""Returning freed heap memory to the operating system between outer rounds.

A DiLoCo worker allocates and frees tens of MB per outer round (the checkpoint's tensors, the state snapshot served to
joiners, the all-reduce's part buffers and encoded chunks). glibc keeps freed blocks in its arenas, and the holes
between blocks still in use are never given back: the resident memory of a tiny-model worker grew from 500 to 750 MB
over 60 outer rounds (``docs/benchmarks.md``). ``malloc_trim(0)`` releases the free pages of every arena.
``PEERD_TRIM_HEAP=0`` in the environment turns it off (``scripts/bench_worker_rss.py`` measures both).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

#: Environment variable: "0" turns :func:`trim_heap` off (the baseline of ``scripts/bench_worker_rss.py``).
TRIM_ENV = "PEERD_TRIM_HEAP"


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Optional[ctypes._CFuncPtr]:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Give the C heap's free pages back to the OS (``malloc_trim(0)``; ~ms per call). True if the C library has
    ``malloc_trim`` and it released memory; False otherwise (and with ``PEERD_TRIM_HEAP=0``), never an error."""
    if os.environ.get(TRIM_ENV) == "0":
        return False
    trim = _malloc_trim()
    if trim is None:
        return False
    try:
        return bool(trim(0))
    except OSError as e:  # pragma: no cover - a C library that refuses: nothing is lost
        logger.debug("malloc_trim failed: %s", e)
        return False
