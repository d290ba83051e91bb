"""The process heap of a training peer: freed memory back to the operating system between outer rounds, and Python's
cyclic garbage collector kept off the long-lived objects.

**Trimming.** A DiLoCo worker allocates and frees tens of MB per outer round (the checkpoint's tensors, the state
snapshot served to joiners, the all-reduce's part buffers and encoded chunks). glibc keeps freed blocks in its arenas,
and the holes between blocks still in use are never given back: the resident memory of a tiny-model worker grew from
500 to 750 MB over 60 outer rounds (``docs/benchmarks.md``). ``malloc_trim(0)`` releases the free pages of every
arena.
``PEERD_TRIM_HEAP=0`` in the environment turns it off (``scripts/bench_worker_rss.py`` measures both).

**Freezing.** A daemon holds ~220,000 objects the collector tracks (the modules of torch, hivemind and peerd, the
model's, the transport's) that live as long as the process. Every full (generation 2) collection walks all of them:
~90 ms of CPU on a quiet core, 120-140 ms on a busy one, and it comes whenever enough survivors accumulated, at any
point of a round. Measured in ``scripts/bench_allreduce.py``: it landed at the start of every peer's ring all-reduce
at once (the first allocations after the previous round's survivors) and delayed the whole ring by 0.1-0.25 s of a
3.4 s all-reduce. :func:`freeze_heap` collects once and then moves every surviving object into the collector's
permanent generation (``gc.freeze``, Python >= 3.7), so that later collections walk only what was allocated after;
objects there are still freed by reference counting. ``PEERD_FREEZE_HEAP=0`` turns it off (the baseline of the
benchmark's comparison).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

#: Environment variable: "0" turns :func:`trim_heap` off (the baseline of ``scripts/bench_worker_rss.py``).
TRIM_ENV = "PEERD_TRIM_HEAP"
#: Environment variable: "0" turns :func:`freeze_heap` off.
FREEZE_ENV = "PEERD_FREEZE_HEAP"


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


def freeze_heap() -> int:
    """Collect the cyclic garbage there is, then move every object the collector still tracks into its permanent
    generation (``gc.collect()``, ``gc.freeze()``): call once the long-lived objects exist (a role after its set-up),
    not per round (a reference cycle frozen while alive is never collected after it dies). Returns the objects frozen
    in all (``gc.get_freeze_count()``); 0 with ``PEERD_FREEZE_HEAP=0``, where nothing is done."""
    if os.environ.get(FREEZE_ENV) == "0":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
