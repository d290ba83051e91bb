"""How a butterfly all-reduce splits the vector: parts per reducer (equal or bandwidth-proportional) and chunks.

**Parts.** Member i reduces part i. With equal parts every member moves about 2 (N-1)/N of the vector, so the
slowest link sets the pace. With bandwidth-proportional parts (the load balancing of Moshpit SGD, Ryabinin et al.
2021, arXiv 2103.03239, appendix "load balancing"; hivemind solves it as an LP) each member reduces a share that
fits its link. Model, for a vector of V bytes and a member i reducing the fraction x_i: as a sender it uploads
(1 - x_i) V and downloads the same back; as a reducer it downloads x_i V from each of the N - 1 others and uploads
x_i V to each. Either direction carries ``V (1 + (N - 2) x_i)``, so with r_i = min(upload_i, download_i) member i
needs ``T_i = V (1 + (N - 2) x_i) / r_i``. :func:`proportional_fractions` minimizes ``max_i T_i`` subject to
``sum x_i = 1, x_i >= 0`` in closed form (water filling: the fastest members take parts until their time reaches
the next member's floor ``V / r_j``); a member with rate 0 reduces nothing. N = 2 moves V each way whatever the
split: the parts are then proportional to r_i.

**Floor.** Rates measured on a shared host or from short transfers are noisy: two members on equal links can
measure 2x apart. Left alone, the split would then give one honest member a sliver or nothing, and a reducer with no
part validates no sender (it cannot see, exclude or ban a sender of garbage). So ``min_share`` keeps every member
within :data:`FLOOR_SPREAD` of the fastest at ``min_share / N`` of the vector at least (the split is mixed with an
equal split of those members); a member slower than that (a truly slow or ~0 link) keeps its optimal share, which is
often 0.

**Chunks.** A part travels in chunks of :data:`CHUNK_NUMEL` values (a multiple of every codec's block, 4096 =
SparseLoCo's top-k chunk, so a chunk encodes and decodes to the same values as the whole part would); a reducer
answers chunk k as soon as every sender's chunk k is in.

Pure: no I/O, deterministic (the same rates give the same sizes on every member).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

#: Values per chunk of a part (512 KiB of fp32; hivemind's averager streams 512 KB parts too).
CHUNK_NUMEL = 128 * 1024
#: Chunk sizes must be multiples of this (the largest block of any codec: top-k's 4096-value chunk).
CHUNK_ALIGN = 4096
#: Largest rate (bytes/s) a member may announce: 1 Tbit/s.
MAX_RATE = 125e9
#: Members at least 1/FLOOR_SPREAD as fast as the fastest keep the ``min_share`` floor (see the module docstring).
FLOOR_SPREAD = 4.0


def partition_sizes(numel: int, n_parts: int) -> list[int]:
    """Split ``numel`` elements into ``n_parts`` contiguous parts whose sizes differ by at most one."""
    if n_parts < 1 or numel < 0:
        raise ValueError(f"need n_parts >= 1 and numel >= 0, got {n_parts}, {numel}")
    base, extra = divmod(numel, n_parts)
    return [base + (1 if i < extra else 0) for i in range(n_parts)]


def proportional_fractions(rates: Sequence[float], min_share: float = 0.0) -> list[float]:
    """Fractions x_i (sum 1, each in [0, 1]) of the vector each member reduces, minimizing the slowest member's time
    under the model of this module. ``rates``: each member's usable rate min(upload, download) (any unit, >= 0,
    finite). ``min_share`` in [0, 1]: every member within :data:`FLOOR_SPREAD` of the fastest gets at least
    ``min_share / N`` (the optimum mixed with an equal split of those members; 0 = the optimum). Raises ValueError if
    a rate is negative or not finite, every rate is 0, or ``min_share`` is outside [0, 1]."""
    if not 0.0 <= min_share <= 1.0:
        raise ValueError(f"min_share must be in [0, 1], got {min_share}")
    fractions = _optimal_fractions(rates)
    if min_share <= 0:
        return fractions
    fastest = max(rates)
    floored = [i for i, r in enumerate(rates) if r > 0 and r * FLOOR_SPREAD >= fastest]
    beta = min_share * len(floored) / len(rates)  # each floored member gets beta / len(floored) = min_share / N
    mixed = [(1.0 - beta) * f for f in fractions]
    for i in floored:
        mixed[i] += beta / len(floored)
    return mixed


def _optimal_fractions(rates: Sequence[float]) -> list[float]:
    rates = [float(r) for r in rates]
    if not rates or any(not math.isfinite(r) or r < 0 for r in rates):
        raise ValueError(f"rates must be finite and >= 0, got {rates}")
    total = sum(rates)
    if total <= 0:
        raise ValueError("at least one member needs a positive rate")
    n = len(rates)
    if n <= 2:
        return [r / total for r in rates]
    order = sorted(range(n), key=lambda i: (-rates[i], i))
    # with the j fastest members reducing: sum_i (T r_i / V - 1) / (N - 2) = 1  =>  T / V = (N - 2 + j) / sum r
    t = 0.0
    for j in range(1, n + 1):
        top = sum(rates[i] for i in order[:j])
        t = (n - 2 + j) / top
        nxt = rates[order[j]] if j < n else 0.0
        if nxt <= 0 or t <= 1.0 / nxt:  # the next member would not take any share at this time
            break
    shares = [max(0.0, (t * r - 1.0) / (n - 2)) for r in rates]
    norm = sum(shares)
    return [s / norm for s in shares]


def proportional_sizes(numel: int, rates: Sequence[float], min_share: float = 0.0) -> list[int]:
    """Integer part sizes (sum ``numel``) following :func:`proportional_fractions` (``min_share`` likewise): floors,
    then the remaining elements one each to the largest remainders (ties to the lower index); a member with rate 0
    gets 0."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    fractions = proportional_fractions(rates, min_share)
    exact = [f * numel for f in fractions]
    sizes = [int(math.floor(e)) for e in exact]
    left = numel - sum(sizes)
    eligible = sorted((i for i in range(len(sizes)) if fractions[i] > 0), key=lambda i: (sizes[i] - exact[i], i))
    for step in range(left):  # fewer than one per member, up to float rounding
        sizes[eligible[step % len(eligible)]] += 1
    return sizes


def valid_rate(value: object) -> Optional[float]:
    """A member's announced rate (bytes/s) if it is a finite number in [0, MAX_RATE], else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and 0 <= value <= MAX_RATE else None


def chunk_bounds(numel: int, chunk_numel: int = CHUNK_NUMEL) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of the chunks of a part of ``numel`` values: full chunks of ``chunk_numel``, the last
    one shorter; one empty chunk for an empty part (it still travels as one empty frame)."""
    if chunk_numel < 1 or numel < 0:
        raise ValueError(f"need chunk_numel >= 1 and numel >= 0, got {chunk_numel}, {numel}")
    if numel == 0:
        return [(0, 0)]
    return [(start, min(start + chunk_numel, numel)) for start in range(0, numel, chunk_numel)]
