"""Butterfly all-reduce of one fp32 vector with sample weights (Zhao & Canny 2013; the scheme of hivemind's averager).

The N members of a sealed group each split the vector (P,) into N contiguous parts. Member i is the *reducer* of
part i: every member sends it part i (encoded by the run's codec), it computes the weighted mean
``sum_j w_j x_j / sum_j w_j`` in fp32, encodes that mean once, and sends the *same bytes* back to every member.
Every member, the reducer included, decodes those bytes: all members end with bit-identical averages, which is what
lets DiLoCo peers keep bit-identical theta_outer. Each member sends and receives about 2 (N-1)/N of the vector.

Sparse codecs (``compression = "topk"``, SparseLoCo, arXiv 2508.15706): members' top-k selections have different
indices, so a reducer cannot average encoded parts, and the mean of N sparse parts (up to N k values, not 2-bit) is
not representable in the sparse codec. SparseLoCo all-gathers the sparse tensors instead (peerd's
``exchange = "gather"``, :mod:`protocols.allgather`); with the default ``exchange = "reduce"`` peerd keeps the
butterfly: each reducer decodes every member's sparse part densely, averages in fp32 as for any codec, and answers
with the mean encoded by a *dense* codec (``result_compression``, fp16 by default). This keeps the reducer fault handling and the
bit-identical guarantee unchanged (every member decodes the same answer bytes) and costs each member about (N-1)/N of
the vector sparse up plus (N-1)/N dense down, independent of N, where a gather costs N-1 sparse vectors each way.
The sender's error feedback needs what its own contribution decoded to: :attr:`AllReduceResult.sent`.

Failure semantics:
- a sender that does not deliver its part within ``sender_timeout_s`` is left out of that part's mean;
- a sender whose request reaches the reducer only after ``sender_timeout_s`` is *late*: left out of that part, not
  banned (a slow but honest peer, e.g. on a loaded host); the reducer drains its bytes and answers it the finished
  mean, so it ends with the same result as every other member (:attr:`AllReduceResult.late`);
- a sender that started before ``sender_timeout_s`` and then stalls mid-part (its part not read by one second after
  that deadline) is left out from the stalled chunk on and banned;
- a sender whose part is invalid (wrong size or shape, non-finite values, weight out of range, malformed frame) is
  left out and reported in :attr:`AllReduceResult.excluded` (the caller bans it);
- a sender that arrives after its reducer finished still receives the finished mean;
- if any reducer fails to answer within ``reducer_timeout_s``, :meth:`ButterflyAllReduce.run` raises
  :class:`AllReduceFailed` and the caller must not use any part (the round failed for this peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from statistics import median
from dataclasses import dataclass, field
import time
import warnings
from typing import Optional, Sequence, Union

import numpy as np
import torch

from protocols.bans import BanList
from protocols.codecs import Codec, TopKCompression, all_finite, get_codec
from protocols.interfaces import StreamReader, StreamWriter, Transport
from protocols.matchmaking import Group
from protocols.robust import AGGREGATIONS, centered_clip
from protocols.partition import (
    CHUNK_ALIGN, CHUNK_NUMEL, chunk_bounds, partition_sizes, proportional_sizes, valid_rate,
)
from protocols.rpc import Refused, Request, RpcError, RpcTimeout, Service, Unreachable, call_framed, until
from protocols.wire import ProtocolViolation, require

logger = logging.getLogger(__name__)

#: Largest weight (samples) a member may claim for one round.
MAX_WEIGHT = 1e12


# ---------------------------------------------------------------------------------------------------------- pure core


def validate_weight(weight: float) -> float:
    """A member's weight must be finite and in [0, MAX_WEIGHT]; returns it as float or raises ValueError."""
    weight = float(weight)
    if not math.isfinite(weight) or weight < 0 or weight > MAX_WEIGHT:
        raise ValueError(f"weight must be finite and in [0, {MAX_WEIGHT:g}], got {weight}")
    return weight


def check_local_input(group: Group, me: str, tensor: torch.Tensor, weight: float) -> float:
    """Validate what this peer brings to a group's reduction: ``tensor`` (P,) fp32, ``weight`` (see
    :func:`validate_weight`) and its own membership; returns the weight as float. Raises ValueError."""
    weight = validate_weight(weight)
    if tensor.dtype != torch.float32 or tensor.dim() != 1:
        raise ValueError(f"tensor must be 1-D float32, got {tensor.dtype} {tuple(tensor.shape)}")
    if me not in group.members:
        raise ValueError("this peer is not a member of the group")
    return weight


def weight_problem(weight: object) -> Optional[str]:
    """None if a weight from a peer's header is acceptable (a number that passes :func:`validate_weight`), else the
    reason to exclude that peer."""
    if not isinstance(weight, (int, float)) or isinstance(weight, bool):
        return "weight is not a number"
    try:
        validate_weight(weight)
    except ValueError as e:
        return str(e)
    return None


class PartReducer:
    """Aggregates one part (numel,) from several senders, in fp32: the weighted mean, or CenteredClip.

    The mean is summed in arrival order; only the reducer computes it and everyone receives its encoded result, so
    the order does not need to agree across peers. ``centered_clip`` keeps every contribution (n x numel floats) and
    clips them around a robust center (:mod:`protocols.robust`) so that a minority of hostile senders cannot drag
    the result away.
    """

    def __init__(self, numel: int, aggregation: str = "mean", clip_tau: float = 1.0, clip_iterations: int = 20):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        self.numel = numel
        self.aggregation = aggregation
        self.clip_tau = clip_tau
        self.clip_iterations = clip_iterations
        self._sum = torch.zeros(numel, dtype=torch.float32)
        self._parts: list[tuple[torch.Tensor, float]] = []
        self.total_weight = 0.0
        self.contributors: list[str] = []

    def add(self, sender: str, part: torch.Tensor, weight: float) -> None:
        """Add ``weight * part``. Raises ValueError (and changes nothing) on a wrong shape, dtype, a non-finite value,
        a bad weight or a second contribution from the same sender."""
        weight = validate_weight(weight)
        if part.dtype != torch.float32 or part.shape != (self.numel,):
            raise ValueError(f"part must be float32 ({self.numel},), got {part.dtype} {tuple(part.shape)}")
        if not all_finite(part):
            raise ValueError("part has non-finite values")
        if sender in self.contributors:
            raise ValueError(f"{sender} already contributed")
        if self.aggregation == "mean":
            self._sum.add_(part, alpha=weight)
        else:
            self._parts.append((part, weight))
        self.total_weight += weight
        self.contributors.append(sender)

    def mean(self) -> torch.Tensor:
        """The aggregate (numel,): weighted mean or CenteredClip; zeros if the total weight is zero."""
        if self.total_weight <= 0:
            return torch.zeros(self.numel, dtype=torch.float32)
        if self.aggregation == "centered_clip":
            parts, weights = zip(*self._parts)
            return centered_clip(parts, weights, self.clip_tau, self.clip_iterations)
        return self._sum / self.total_weight


class ChunkedPartReducer:
    """Aggregates one part (numel,) from several senders chunk by chunk, in fp32 (see :class:`PartReducer`).

    ``bounds`` are the chunks' ``(start, stop)`` (:func:`protocols.partition.chunk_bounds`). A sender adds its chunks
    in order; chunk k's aggregate is available as soon as the caller decides chunk k is complete. With ``mean`` the
    aggregate of chunk k is the weighted mean over the senders that delivered chunk k (validation and exclusion are
    per chunk: a sender whose chunk k is invalid is left out of chunk k and every later one). ``centered_clip``
    clips whole parts (the robust center needs every coordinate): its aggregate uses the senders that delivered every
    chunk and is available once all chunks are complete.
    """

    def __init__(self, numel: int, bounds: Sequence[tuple[int, int]], aggregation: str = "mean",
                 clip_tau: float = 1.0, clip_iterations: int = 20):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        self.numel = numel
        self.bounds = list(bounds)
        self.aggregation = aggregation
        self.clip_tau = clip_tau
        self.clip_iterations = clip_iterations
        self._sum = torch.zeros(numel if aggregation == "mean" else 0, dtype=torch.float32)
        self._chunk_weight = [0.0] * len(self.bounds)
        self._aggregated = [False] * len(self.bounds)  # mean: chunk k of _sum now holds its aggregate
        self._parts: dict[str, torch.Tensor] = {}  # centered_clip: every sender's whole part
        self._weights: dict[str, float] = {}
        self.delivered: dict[str, int] = {}
        """Chunks each sender delivered (in order)."""
        self._clipped: Optional[torch.Tensor] = None

    @property
    def contributors(self) -> list[str]:
        """Senders that delivered every chunk, in arrival order of their first chunk."""
        return [s for s, n in self.delivered.items() if n == len(self.bounds)]

    @property
    def total_weight(self) -> float:
        return sum(self._weights[s] for s in self.contributors)

    def add(self, sender: str, k: int, chunk: torch.Tensor, weight: float, finite_checked: bool = False) -> None:
        """Add ``sender``'s chunk ``k`` (fp32, the chunk's length) with ``weight``. Raises ValueError (and changes
        nothing) on a wrong shape or dtype, a non-finite value (unless ``finite_checked``), a bad weight, a weight
        that differs from the sender's earlier chunks, or a chunk out of order."""
        weight = validate_weight(weight)
        start, stop = self.bounds[k]
        if chunk.dtype not in (torch.float32, torch.float16) or chunk.shape != (stop - start,):
            raise ValueError(f"chunk must be float32 or float16 ({stop - start},), got {chunk.dtype} "
                             f"{tuple(chunk.shape)}")
        if self.delivered.get(sender, 0) != k:
            raise ValueError(f"{sender} sent chunk {k} after {self.delivered.get(sender, 0)} chunks")
        if self._aggregated[k]:
            raise ValueError(f"chunk {k} was already aggregated")
        if self._weights.setdefault(sender, weight) != weight:
            raise ValueError(f"{sender} changed its weight mid-part")
        if not finite_checked and not finite(chunk):
            raise ValueError("chunk has non-finite values")
        if self.aggregation == "mean":
            self._sum[start:stop].add_(chunk, alpha=weight)  # fp16 is widened exactly inside the add
            self._chunk_weight[k] += weight
        else:
            part = self._parts.get(sender)
            if part is None:
                part = self._parts[sender] = torch.empty(self.numel, dtype=torch.float32)
            part[start:stop] = chunk
        self.delivered[sender] = k + 1

    def chunk_aggregate(self, k: int) -> torch.Tensor:
        """Chunk ``k``'s aggregate (its length,), fp32: the weighted mean of the senders that delivered it, or its
        slice of the CenteredClip of the complete parts; zeros if their total weight is zero. With ``mean`` the
        first call closes chunk k (later :meth:`add` calls for it raise ValueError) and divides its sum in place:
        the result is a view of this reducer's memory, the same on every call."""
        start, stop = self.bounds[k]
        if self.aggregation == "mean":
            chunk = self._sum[start:stop]
            if not self._aggregated[k]:  # in place: no buffer of its own, one pass less than a fresh quotient
                self._aggregated[k] = True
                weight = self._chunk_weight[k]
                if weight <= 0:
                    chunk.zero_()
                else:
                    chunk.div_(weight)
            return chunk
        if self._clipped is None:
            complete = [s for s in self.contributors if self._weights[s] > 0]
            if not complete:
                self._clipped = torch.zeros(self.numel, dtype=torch.float32)
            else:
                self._clipped = centered_clip([self._parts[s] for s in complete], [self._weights[s] for s in complete],
                                              self.clip_tau, self.clip_iterations)
        return self._clipped[start:stop]


# ---------------------------------------------------------------------------------------------------- fast paths


def finite(x: torch.Tensor) -> bool:
    """True if every value of the CPU float tensor ``x`` is finite: one fp32 sum (a finite sum proves every term
    finite), then a value-by-value check only if the sum is not. Per chunk this is much cheaper than
    :func:`protocols.codecs.all_finite`, whose numpy error-state guard costs ~0.1-0.5 ms a call."""
    if x.numel() == 0:
        return True
    return math.isfinite(float(torch.sum(x, dtype=torch.float32))) or bool(torch.isfinite(x).all())


def _readonly_view(buf: Union[bytes, bytearray, memoryview], dtype: str) -> torch.Tensor:
    """A tensor over ``buf``'s memory, no copy; never written (torch warns about read-only buffers, harmlessly)."""
    array = np.frombuffer(buf, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


_RAW_DTYPES = {"none": "<f4", "fp16": "<f2"}


def decode_chunk(codec: Codec, buf: Union[bytes, bytearray, memoryview], numel: int) -> torch.Tensor:
    """Decode ``numel`` values of an untrusted chunk, checked finite; for codecs ``none`` and ``fp16`` a read-only
    view of ``buf`` (fp32 or fp16: no copy, no conversion pass; fp16 -> fp32 is exact wherever it is added), else
    fp32. Raises ValueError on a wrong size or non-finite values."""
    raw = _RAW_DTYPES.get(codec.name)
    if raw is None:
        return codec.decode(buf, numel)
    if len(memoryview(buf).cast("B")) != codec.encoded_size(numel):
        raise ValueError(f"{codec.name}: expected {codec.encoded_size(numel)} bytes for {numel} values, got {len(buf)}")
    values = _readonly_view(buf, raw)
    if not finite(values):
        raise ValueError(f"{codec.name}: decoded values are not all finite")
    return values


def decode_chunk_into(codec: Codec, buf: Union[bytes, bytearray, memoryview], out: torch.Tensor,
                      trusted: bool = False) -> None:
    """Decode an untrusted chunk straight into ``out`` (fp32, its length); ValueError as :func:`decode_chunk`.
    ``trusted``: ``buf`` holds values this peer already checked finite (its own aggregate, codec ``none``), so the
    finiteness pass is skipped."""
    raw = _RAW_DTYPES.get(codec.name)
    if raw is None:
        out.copy_(codec.decode(buf, out.numel()))
        return
    if len(memoryview(buf).cast("B")) != codec.encoded_size(out.numel()):
        raise ValueError(f"{codec.name}: expected {codec.encoded_size(out.numel())} bytes, got {len(buf)}")
    out.copy_(_readonly_view(buf, raw))
    if not trusted and not finite(out):
        raise ValueError(f"{codec.name}: decoded values are not all finite")


def encode_chunk(codec: Codec, chunk: torch.Tensor, checked: bool = False) -> Union[bytes, memoryview]:
    """Encode a fp32 chunk; for codec ``none`` a view of its memory (no copy: keep it unmodified until sent).
    ``checked``: the caller already checked every value finite (e.g. once for the whole vector), so the codec's
    own per-call check is skipped. Raises ValueError on non-finite values otherwise."""
    if checked:
        return codec._encode_flat(chunk.contiguous())
    return codec.encode_tensor(chunk)[1]


# ------------------------------------------------------------------------------------------------------------ runner

#: Partition modes: ``equal`` parts, or ``bandwidth``-proportional ones where every member announced its rates.
PARTITIONS = ("equal", "bandwidth")
#: How members combine their vectors: the butterfly ``reduce``, or ``gather`` (sparse codecs only).
EXCHANGES = ("reduce", "gather")
#: Announced rates that differ by less than this factor give equal parts (bandwidth partition only).
RATE_SPREAD = 1.5
#: A member's announced rates are the median of its last RATE_HISTORY measured runs...
RATE_HISTORY = 5
#: ...and are announced only once RATE_MIN_RUNS runs were measured (before that: equal parts).
RATE_MIN_RUNS = 3
#: A run's measurement counts only if it moved at least this many bytes each way: short transfers measure latency
#: and the event loop, not the link.
RATE_MIN_BYTES = 4 << 20
#: A sender still sending after ``sender_timeout_s`` is slow, not stalled, while each next chunk arrives within this
#: many times its average time per chunk so far...
SLOW_SENDER_PACES = 4.0
#: ...and at least this many seconds (its chunks sealed without it are read and dropped, nothing is banned).
SLOW_SENDER_GRACE_S = 1.0
#: With bandwidth-proportional parts, every member within partition.FLOOR_SPREAD of the fastest reduces at least
#: MIN_SHARE of an equal part, so that every honest reducer validates (and can exclude) every sender.
MIN_SHARE = 0.25


@dataclass(frozen=True)
class AllReduceConfig:
    """Wire format and timeouts (seconds) of one all-reduce."""

    compression: str = "fp16"
    """Codec for parts (and, if dense, results) on the wire: none | fp16 | bf16 | int8 | fp4 | sign | topk."""
    sender_timeout_s: float = 30.0
    """A reducer waits this long, from its own start, for the members' parts before averaging without them."""
    reducer_timeout_s: float = 60.0
    """A member waits this long, from its start, for every reducer's answer before the all-reduce fails."""
    aggregation: str = "mean"
    """How a reducer combines its part: mean (weighted) or centered_clip (robust to a minority of bad senders)."""
    clip_tau: float = 1.0
    """CenteredClip radius, in the units of the averaged values (per part: each reducer clips its own part)."""
    result_compression: str = "auto"
    """Dense codec of the reducers' answers; auto: ``compression`` if it is dense, else fp16."""
    chunk_numel: int = CHUNK_NUMEL
    """Values per chunk of a part on the wire (a multiple of 4096); every member of a run must use the same."""
    partition: str = "bandwidth"
    """equal | bandwidth: bandwidth-proportional parts when every member announced ``rates`` in its group info
    (:meth:`ButterflyAllReduce.announce`), else equal parts."""
    topk_fraction: float = 0.02
    """Sparse codec ``topk`` only: the fraction of each 4096-value chunk that travels (SparseLoCo's density), in
    (0, 1]; every member of a run must use the same."""
    exchange: str = "reduce"
    """reduce | gather. reduce: the butterfly all-reduce (this module). gather: every member sends its encoded
    vector to every other and all sum the same bytes (:class:`protocols.allgather.SparseAllGather`, SparseLoCo);
    needs a sparse ``compression`` (topk) and ``aggregation = "mean"``."""

    def __post_init__(self) -> None:
        get_codec(self.compression)
        if self.result_compression != "auto" and get_codec(self.result_compression).sparse:
            raise ValueError(f"result_compression must be a dense codec, got {self.result_compression!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.clip_tau <= 0:
            raise ValueError(f"clip_tau must be positive, got {self.clip_tau}")
        if self.sender_timeout_s <= 0:
            raise ValueError(f"sender_timeout_s must be positive, got {self.sender_timeout_s}")
        if self.reducer_timeout_s <= self.sender_timeout_s:
            raise ValueError(
                f"reducer_timeout_s ({self.reducer_timeout_s}) must exceed sender_timeout_s ({self.sender_timeout_s}):"
                " a reducer may legitimately wait sender_timeout_s for a slow sender before it answers"
            )
        if (isinstance(self.chunk_numel, bool) or not isinstance(self.chunk_numel, int) or self.chunk_numel < 1
                or self.chunk_numel % CHUNK_ALIGN):
            raise ValueError(f"chunk_numel must be a positive multiple of {CHUNK_ALIGN}, got {self.chunk_numel!r}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if (isinstance(self.topk_fraction, bool) or not isinstance(self.topk_fraction, (int, float))
                or not 0 < self.topk_fraction <= 1):
            raise ValueError(f"topk_fraction must be in (0, 1], got {self.topk_fraction!r}")
        object.__setattr__(self, "topk_fraction", float(self.topk_fraction))  # equal configs print alike
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if self.exchange == "gather" and not get_codec(self.compression).sparse:
            raise ValueError(f"exchange = 'gather' needs a sparse compression (topk), got {self.compression!r}: "
                             "a dense vector is cheaper to all-reduce")
        if self.exchange == "gather" and self.aggregation != "mean":
            raise ValueError(f"exchange = 'gather' sums with aggregation = 'mean', got {self.aggregation!r}")


    def make_codec(self) -> Codec:
        """The codec of ``compression``, with ``topk_fraction`` for ``topk``."""
        if self.compression == "topk":
            return TopKCompression(self.topk_fraction)
        return get_codec(self.compression)


class AllReduceFailed(Exception):
    """This peer did not obtain every part's mean; it must not use the result."""


class _InvalidMean(Exception):
    """A reducer answered with bytes that do not decode to finite values of the right size."""


@dataclass
class AllReduceResult:
    """What one member obtained. ``averaged`` is (P,) fp32, identical on every member that got a result."""

    averaged: torch.Tensor
    group_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    contributors: int
    """How many members contributed every chunk of this peer's own part (its reducer view)."""
    excluded: dict[str, str] = field(default_factory=dict)
    """Members whose part this peer refused as reducer, with the reason."""
    sent: Optional[torch.Tensor] = None
    """(P,) fp32: what this member's contribution decoded to at the reducers; set for sparse codecs only (for
    :class:`protocols.codecs.ErrorFeedback`)."""
    part_sizes: tuple[int, ...] = ()
    """Values each member reduced, in member order (equal or bandwidth-proportional)."""
    late: tuple[str, ...] = ()
    """Members whose part reached this peer (as reducer) only after ``sender_timeout_s``: left out, not banned. A
    slow member still sending when this peer returns is not listed yet (the reducer's session lists it later)."""


@dataclass
class _ReduceSession:
    group: Group
    part_numel: int
    bounds: list[tuple[int, int]]
    codec: Codec
    reducer: ChunkedPartReducer
    deadline: float
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on every chunk arrival and exclusion (the sealer clears it before it waits)."""
    sealed: list = field(default_factory=list)
    """The encoded aggregate of each sealed chunk, in order: the same bytes go to every member."""
    sealed_event: asyncio.Event = field(default_factory=asyncio.Event)
    """Replaced by a fresh event and set on every seal."""
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    excluded: dict[str, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    answers: int = 0
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    late_logged: bool = False
    late: list = field(default_factory=list)
    """Members whose request arrived after the sender deadline (read and answered, never added), or who kept sending
    at their pace after it (their chunks sealed without them read and dropped): never banned."""
    downloads: list = field(default_factory=list)
    """``(bytes, seconds from our start)`` of every member's part that arrived whole."""
    gone: set = field(default_factory=set)
    """Members whose reducer our call could not get an answer from: not waited for (neither excluded nor banned; a
    part they still send is taken for the chunks not sealed yet)."""

    def resolved(self, k: int) -> bool:
        """Every member delivered chunk ``k``, was excluded or is gone."""
        delivered = self.reducer.delivered
        return all(m in self.excluded or m in self.gone or delivered.get(m, 0) > k for m in self.group.members)


class ButterflyAllReduce(Service):
    """Runs butterfly all-reduces for groups formed by :class:`protocols.matchmaking.Matchmaker`.

    An RPC service (:mod:`protocols.rpc`) named ``prefix`` with one method, ``reduce`` (stream handler
    ``<prefix>.reduce``). A member's request is one message carrying its slice of our part (header ``group_id``,
    ``numel``, ``weight``, ``codec``), framed in chunks of ``chunk_numel`` values, each chunk encoded on its own;
    the reply is one message carrying the encoded aggregate, framed the same way. Both travel at once
    (:func:`protocols.rpc.call_framed`): the reducer answers chunk k as soon as every member's chunk k is in (or the
    member was excluded), while later chunks are still arriving, so the two phases of the butterfly overlap. A part
    of one chunk is byte for byte the message of the unchunked protocol.

    Call :meth:`start` once, then :meth:`run` once per group. :meth:`announce` gives the rates to put into the group
    info for bandwidth-proportional parts.
    """

    def __init__(self, transport: Transport, prefix: str, config: AllReduceConfig, bans: Optional[BanList] = None):
        self.transport = transport
        self.prefix = self.name = prefix
        self.config = config
        self.request_timeout_s = config.sender_timeout_s  # a sender stalled inside its header is banned
        self.bans = bans if bans is not None else BanList()
        self.codec = config.make_codec()
        result = config.result_compression
        if result == "auto":
            result = "fp16" if self.codec.sparse else config.compression
        self.result_codec = get_codec(result)
        self._sessions: dict[str, _ReduceSession] = {}
        self._session_ready: dict[str, asyncio.Event] = {}
        self.dial_only = False
        """This peer cannot be dialed directly (behind a NAT): announced in the group info, it then reduces no part
        while another member can (:meth:`part_sizes`); it still sends its own parts, dialing out. Set it per round."""
        self.rates: Optional[dict[str, float]] = None
        """This peer's rates in bytes/s, ``{"up", "down"}``: set by the operator, or measured from the all-reduce's
        own transfers: the median of the last :data:`RATE_HISTORY` runs that moved at least :data:`RATE_MIN_BYTES`
        each way, once there are :data:`RATE_MIN_RUNS` of them (a median: one run slowed or sped up by other load
        on the host does not move it). A run's estimate is the sum over its concurrent streams of each stream's
        bytes over that stream's own duration: a stream slowed by the other end's link counts at its own pace, so
        the sum approaches this peer's link rate when it is the bottleneck."""
        self._rate_history: deque = deque(maxlen=RATE_HISTORY)

    @property
    def handler_name(self) -> str:
        return self.handler_name_of("reduce")

    def stream_handler(self, method: str):
        return self._handle_part  # a seam: tests wrap the reducer's side of a member's stream

    async def _handle_part(self, peer: str, reader: StreamReader, writer: StreamWriter) -> None:
        await self.serve("reduce", peer, reader, writer)

    def announce(self) -> dict:
        """Group-info entries for the matchmaking: ``{"rates": {"up", "down"}}`` once known, ``{"dial_only": true}``
        while :attr:`dial_only`; ``{}`` for neither."""
        out: dict = {"rates": dict(self.rates)} if self.rates else {}
        if self.dial_only:
            out["dial_only"] = True
        return out

    def part_sizes(self, group: Group, numel: int) -> list[int]:
        """Values each member reduces, in member order. Members that announced ``dial_only`` reduce nothing while
        another member can (a reducer is dialed by every sender: a dial-only reducer would pull every sender's part
        through a relay, or fail it); the others' parts are bandwidth-proportional
        (:func:`protocols.partition.proportional_sizes` of min(up, down)) if ``partition == "bandwidth"``, every
        one of them announced valid rates and the fastest is more than :data:`RATE_SPREAD` times the slowest, else
        equal. Every member computes the same sizes."""
        infos = group.infos if isinstance(group.infos, dict) else {}
        reducers = [m for m in group.members
                    if not (isinstance(infos.get(m), dict) and infos[m].get("dial_only") is True)]
        if not reducers or len(reducers) == len(group.members):
            return self._reducer_sizes(group.members, infos, numel)
        sizes = dict(zip(reducers, self._reducer_sizes(reducers, infos, numel)))
        return [sizes.get(m, 0) for m in group.members]

    def _reducer_sizes(self, members: Sequence[str], infos: dict, numel: int) -> list[int]:
        if self.config.partition == "bandwidth" and len(members) > 1:
            rates = []
            for member in members:
                info = infos.get(member)
                announced = info.get("rates") if isinstance(info, dict) else None
                up = valid_rate(announced.get("up")) if isinstance(announced, dict) else None
                down = valid_rate(announced.get("down")) if isinstance(announced, dict) else None
                if up is None or down is None:
                    break
                rates.append(min(up, down))
            else:
                # rates within RATE_SPREAD of each other are measurement noise: equal parts are as good, and stable
                if sum(rates) > 0 and max(rates) > RATE_SPREAD * min(rates):
                    return proportional_sizes(numel, rates, MIN_SHARE)
        return partition_sizes(numel, len(members))

    def _round_trip(self, part: torch.Tensor) -> torch.Tensor:
        """What ``part`` decodes to at its reducer (fp32, its length). Chunks are multiples of every codec's block,
        so the whole part round-trips to the same values as its chunks do, in one call."""
        if self.codec.name == "none":
            return part
        return self.codec.decode(encode_chunk(self.codec, part, checked=True), part.numel())

    async def run(self, group: Group, tensor: torch.Tensor, weight: float) -> AllReduceResult:
        """Average ``tensor`` (P,) fp32 with the group, weighted by ``weight`` (e.g. samples processed).

        Every member must call this with the same group and the same P. Raises :class:`AllReduceFailed` if any part's
        mean could not be obtained within ``reducer_timeout_s``; ValueError on bad local input.
        """
        me = self.transport.streams.peer_id
        weight = check_local_input(group, me, tensor, weight)
        loop = asyncio.get_running_loop()
        start = loop.time()
        cpu_start = time.process_time()
        sizes = self.part_sizes(group, tensor.numel())
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        my_index = group.members.index(me)
        tensor = tensor.detach().cpu().contiguous()

        bounds = chunk_bounds(sizes[my_index], self.config.chunk_numel)
        session = _ReduceSession(
            group, sizes[my_index], bounds, self.codec,
            ChunkedPartReducer(sizes[my_index], bounds, self.config.aggregation, self.config.clip_tau),
            start + self.config.sender_timeout_s,
        )
        for member in group.members:  # do not wait for parts we would refuse anyway
            if member != me and self.bans.is_banned(member):
                session.excluded[member] = f"banned: {self.bans.reason(member)}"
        if not finite(tensor):  # once for the whole vector: chunks are then encoded without their own check
            raise ValueError("cannot encode non-finite values")
        own = tensor[offsets[my_index] : offsets[my_index] + sizes[my_index]]
        own_sent = self._round_trip(own)
        for k, (a, b) in enumerate(bounds):
            session.reducer.add(me, k, own_sent[a:b], weight, finite_checked=True)
        self._sessions[group.group_id] = session
        self._session_ready.setdefault(group.group_id, asyncio.Event()).set()
        sealer = asyncio.ensure_future(self._seal_chunks(session))
        averaged = torch.empty_like(tensor)
        uploaded: list[tuple[int, float]] = []

        async def exchange(i: int, peer: str) -> tuple[torch.Tensor, int, int]:
            if not sizes[i]:  # it reduces nothing: no stream (a dial-only member is dialed by nobody)
                return averaged[offsets[i]:offsets[i]], 0, 0
            try:
                return await self._exchange(peer, group, tensor[offsets[i] : offsets[i] + sizes[i]], weight, start,
                                            averaged[offsets[i] : offsets[i] + sizes[i]], uploaded)
            except AllReduceFailed:
                self._give_up_on(session, peer)
                raise

        try:
            calls = [exchange(i, peer) for i, peer in enumerate(group.members) if peer != me]
            results = await asyncio.gather(sealer, *calls, return_exceptions=True)
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                raise AllReduceFailed(f"{len(failures)} part(s) missing: {failures[0]!r}") from failures[0]
            sent = received = 0
            others = iter(results[1:])
            for i, peer in enumerate(group.members):
                target = averaged[offsets[i] : offsets[i] + sizes[i]]
                if peer == me:
                    # codec none: the sealed bytes are our aggregate, checked finite when sealed; a lossy codec
                    # may overflow when encoding, so its bytes are checked like any reducer's
                    trusted = self.result_codec.name == "none"
                    for k, (a, b) in enumerate(bounds):
                        decode_chunk_into(self.result_codec, session.sealed[k], target[a:b], trusted)
                    continue
                part, b_sent, b_received = next(others)
                sent, received = sent + b_sent, received + b_received
                if part.numel() and part.data_ptr() != target.data_ptr():  # an override decoded elsewhere
                    target.copy_(part)
            sent_parts = None
            if self.codec.sparse:
                sent_parts = torch.cat([own_sent if peer == me else
                                        self._round_trip(tensor[offsets[i] : offsets[i] + sizes[i]])
                                        for i, peer in enumerate(group.members)])
            await self._wait_answers_written(session)
            seconds = loop.time() - start
            self._measure(uploaded, session.downloads)
            logger.info("all-reduce of group %s (%s) done: %d members", group.group_id, group.key, len(group.members),
                        extra={"event": "allreduce", "group_id": group.group_id, "key": group.key,
                               "group_size": len(group.members), "part_numel": sizes[my_index],
                               "cpu_s": time.process_time() - cpu_start})
            return AllReduceResult(
                averaged,
                len(group.members),
                sent + session.bytes_sent,
                received + session.bytes_received,
                seconds,
                len(session.reducer.contributors),
                dict(session.excluded),
                sent_parts,
                tuple(sizes),
                tuple(session.late),
            )
        finally:
            sealer.cancel()
            if not session.finished.is_set():  # we failed before our part was sealed: answer what we have
                try:
                    while len(session.sealed) < len(session.bounds):
                        self._seal_next(session)
                except ValueError as e:  # an aggregate that overflowed: the waiting members time out
                    logger.warning("could not seal our part of group %s: %s", group.group_id, e)
                session.finished.set()
            asyncio.get_running_loop().call_later(
                self.config.reducer_timeout_s, self._forget, group.group_id
            )

    def _measure(self, uploads: list[tuple[int, float]], downloads: list[tuple[int, float]]) -> None:
        """Fold one run's streams, ``(bytes, seconds)`` each, into :attr:`rates` (bytes/s): see there."""
        up = sum(b / t for b, t in uploads if t > 0)
        down = sum(b / t for b, t in downloads if t > 0)
        if up <= 0 or down <= 0:
            return
        if sum(b for b, _ in uploads) < RATE_MIN_BYTES or sum(b for b, _ in downloads) < RATE_MIN_BYTES:
            return
        self._rate_history.append((up, down))
        if len(self._rate_history) >= RATE_MIN_RUNS:
            self.rates = {"up": median(u for u, _ in self._rate_history),
                          "down": median(d for _, d in self._rate_history)}

    async def _wait_answers_written(self, session: _ReduceSession, grace_s: float = 2.0) -> None:
        """Let our answers to the other contributors finish (briefly), so the byte counts are complete."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while session.answers < len(session.reducer.contributors) - 1 and loop.time() < deadline:
            session.answered.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(session.answered.wait(), deadline - loop.time())

    @staticmethod
    def _give_up_on(session: _ReduceSession, peer: str) -> None:
        """Our call to reducer ``peer`` failed, so this round fails for us (its part is missing): stop waiting for
        ``peer``'s own part as well (``gone``: not excluded, not banned, its part still taken if it comes), so our
        part is sealed with whoever delivered and the other members learn of the failure at once instead of at
        ``sender_timeout_s``. A reducer that died before it sent us its part would otherwise hold every member's
        round until that deadline."""
        if session.reducer.delivered.get(peer, 0) < len(session.bounds):
            session.gone.add(peer)
            session.changed.set()

    def _forget(self, group_id: str) -> None:
        self._sessions.pop(group_id, None)
        self._session_ready.pop(group_id, None)

    def _seal_next(self, session: _ReduceSession) -> None:
        """Encode the next chunk's aggregate and wake the answers waiting for it. Raises ValueError if it is not
        finite (an overflow)."""
        k = len(session.sealed)
        aggregate = session.reducer.chunk_aggregate(k)
        if not finite(aggregate):
            raise ValueError(f"the aggregate of chunk {k} is not finite (an overflow)")
        session.sealed.append(encode_chunk(self.result_codec, aggregate, checked=True))
        woken, session.sealed_event = session.sealed_event, asyncio.Event()
        woken.set()

    async def _seal_chunks(self, session: _ReduceSession) -> None:
        """Seal this peer's part chunk by chunk: chunk k once every member delivered it or was excluded (for
        centered_clip: once every chunk is complete), every chunk still open once the sender timeout passed."""
        if session.part_numel == 0:  # nothing to reduce: senders skip an empty part, so nobody is coming
            while len(session.sealed) < len(session.bounds):
                self._seal_next(session)
            session.finished.set()
            return
        last = len(session.bounds) - 1
        whole_part = session.reducer.aggregation != "mean"

        async def seal_in_order() -> None:
            while len(session.sealed) < len(session.bounds):
                needed = last if whole_part else len(session.sealed)
                if session.resolved(needed):
                    self._seal_next(session)
                else:
                    session.changed.clear()
                    await session.changed.wait()

        try:
            await until(seal_in_order(), session.deadline)  # one timer for the part, not one per wake-up
        except asyncio.TimeoutError:
            k = len(session.sealed)
            missing = [m for m in session.group.members if m not in session.excluded and m not in session.gone
                       and session.reducer.delivered.get(m, 0) <= (last if whole_part else k)]
            # senders that never connected are dead or failed locally: no ban (the next round may have them back);
            # a sender that connected but stalled mid-part is banned in rpc_reduce
            logger.info("averaging part from chunk %d on without %d late sender(s): %s", k, len(missing),
                        sorted(missing))
            session.late_logged = True
            while len(session.sealed) < len(session.bounds):
                self._seal_next(session)
        session.finished.set()

    async def _exchange(
        self, peer: str, group: Group, part: torch.Tensor, weight: float, start: float,
        out: Optional[torch.Tensor] = None, uploaded: Optional[list] = None,
    ) -> tuple[torch.Tensor, int, int]:
        """Send our slice of ``peer``'s part, chunk by chunk, while its aggregate streams back into ``out`` (fp32,
        the part's length; allocated if None). Returns ``(out, bytes sent, bytes received)``; appends ``(bytes, seconds
        since start)`` to ``uploaded`` once our last chunk was handed to the transport."""
        loop = asyncio.get_running_loop()
        timeout = start + self.config.reducer_timeout_s - loop.time()
        header = {"group_id": group.group_id, "numel": part.numel(), "weight": weight, "codec": self.codec.name}
        bounds = chunk_bounds(part.numel(), self.config.chunk_numel)
        out = torch.empty(part.numel(), dtype=torch.float32) if out is None else out

        sizes = [self.codec.encoded_size(b - a) for a, b in bounds]

        def frames():
            for a, b in bounds:
                yield self._encode_part(part[a:b])
            if uploaded is not None:
                uploaded.append((sum(sizes), loop.time() - start))

        def on_frame(k: int, payload) -> None:
            a, b = bounds[k]
            try:
                decode_chunk_into(self.result_codec, payload, out[a:b])
            except ValueError as e:
                raise _InvalidMean(str(e)) from None

        try:
            _, sent, received = await call_framed(
                self.transport.streams, peer, self.prefix, "reduce", header, frames(), sizes,
                [self.result_codec.encoded_size(b - a) for a, b in bounds], on_frame,
                timeout_s=max(timeout, 0.0))
        except RpcTimeout:
            raise AllReduceFailed(f"reducer {peer} did not answer within reducer_timeout_s") from None
        except Refused as e:
            raise AllReduceFailed(f"reducer {peer} refused our part: {e.reason}") from e
        except RpcError as e:
            raise AllReduceFailed(f"reducer {peer} failed: {e!r}") from e
        except _InvalidMean as e:  # wrong size or non-finite values: a faulty or hostile reducer
            self.bans.ban(peer, f"sent an invalid mean: {e}")
            raise AllReduceFailed(f"reducer {peer} failed: sent an invalid mean: {e}") from None
        return out, sent, received

    def _encode_part(self, part: torch.Tensor) -> Union[bytes, memoryview]:
        """Encode one chunk of our slice of another member's part (a seam for fault-injection tests); run() checked
        the whole vector finite."""
        return encode_chunk(self.codec, part, checked=True)

    def on_bad_request(self, peer: str, method: str, error: RpcError) -> None:
        """Garbage (or a stall) before we even know the part's group: ban the sender, exclude it everywhere."""
        if isinstance(error, RpcTimeout):  # connected, then stalled inside its header: as bad as a malformed one
            error = ProtocolViolation(f"part header not delivered within sender_timeout_s={self.config.sender_timeout_s}")
        logger.warning("dropped a part from %s: %r", peer, error)
        self.bans.ban(peer, f"malformed part header: {error}")
        for other in self._sessions.values():
            if peer in other.group.members and peer not in other.reducer.delivered:
                other.excluded.setdefault(peer, f"malformed part header: {error}")
                other.changed.set()

    def _exclude(self, session: _ReduceSession, peer: str, reason: str) -> None:
        session.excluded[peer] = reason
        self.bans.ban(peer, reason)
        session.changed.set()
        logger.warning("excluded %s from group %s: %s", peer, session.group.group_id, reason,
                       extra={"event": "exclude", "peer": peer, "reason": reason})

    async def rpc_reduce(self, request: Request) -> None:
        """Serve one member's part of our reduction: validate and accumulate it chunk by chunk while answering each
        chunk's aggregate as soon as it is sealed."""
        cfg = self.config
        peer, header = request.peer, request.header
        group_id = require(header, "group_id", str)  # a ProtocolViolation goes to on_bad_request
        try:
            # the sender may have learned of the group before we did: wait for our own run() to start
            ready = self._session_ready.setdefault(group_id, asyncio.Event())
            await asyncio.wait_for(ready.wait(), cfg.sender_timeout_s)
            session = self._sessions[group_id]
        except (asyncio.TimeoutError, KeyError) as e:
            if not self._sessions.get(group_id):
                self._session_ready.pop(group_id, None)
            logger.warning("dropped a part from %s: %r", peer, e)
            raise Refused(f"unknown group: {e!r}") from None
        banned = session.excluded.get(peer, "") if session.excluded.get(peer, "").startswith("banned: ") else (
            f"banned: {self.bans.reason(peer)}" if self.bans.is_banned(peer) else "")
        if banned and peer not in session.reducer.delivered:
            # refused, the ban not renewed: it lapses after ban_s. Renewed at each refusal, a peer banned once (e.g.
            # a sender that died mid-part, restarted with its identity) stayed banned as long as it kept averaging
            session.excluded.setdefault(peer, banned)
            session.changed.set()
            raise Refused(banned)
        sizes = [session.codec.encoded_size(b - a) for a, b in session.bounds]
        reason = self._check_header(session, peer, header, request.size, sum(sizes))
        if reason is not None:
            self._exclude(session, peer, reason)
            raise Refused(reason)
        # "late" is decided once, when the request arrives: a sender that never started before our deadline is not
        # a staller, whatever its pace afterwards (the part was sealed without it)
        late = asyncio.get_running_loop().time() >= session.deadline
        if late:
            session.late.append(peer)
            logger.info("%s sent its part of group %s after sender_timeout_s=%s: left out, answered the mean",
                        peer, group_id, cfg.sender_timeout_s, extra={"event": "late_sender", "peer": peer})
        reply_sizes = [self.result_codec.encoded_size(b - a) for a, b in session.bounds]
        answering = asyncio.ensure_future(self._answer(request, session, reply_sizes))
        try:
            reason = await self._receive(request, session, sizes, float(header["weight"]), late)
        except BaseException:
            answering.cancel()
            raise
        if reason is not None:
            answering.cancel()
            with contextlib.suppress(BaseException):
                await answering  # a frame being written is complete before the refusal follows it
            self._exclude(session, peer, reason)
            raise Refused(reason)
        await answering
        if not request.replied:
            raise Refused("our aggregate was not ready within reducer_timeout_s", "timeout")

    async def _receive(self, request: Request, session: _ReduceSession, sizes: list[int],
                       weight: float, late: bool = False) -> Optional[str]:
        """Read a member's chunks into our reducer; None, or the reason to exclude it. A ``late`` member's chunks
        are only read (drained, so that its call completes), within ``reducer_timeout_s`` from now (its own call
        ends by then); if it breaks off or times out, raises Refused without a ban.

        A member still sending when our part is sealed is *slow*, not stalled, while it keeps its pace: each chunk
        gives it :data:`SLOW_SENDER_PACES` times its average time per chunk (at least :data:`SLOW_SENDER_GRACE_S`)
        for the next one, up to ``reducer_timeout_s`` (and never less than 1 s past the sender deadline); its chunks
        sealed without it are only read, and it is reported in ``late``, not banned. One that sends nothing for
        longer is stalled: excluded and banned."""
        peer, k = request.peer, 0
        loop = asyncio.get_running_loop()
        opened = loop.time()
        dropped = 0

        def on_frame(index: int, payload) -> None:
            nonlocal k, dropped
            k = index
            if not late and len(session.sealed) <= index:  # a late sender's chunks are only read
                a, b = session.bounds[index]
                session.reducer.add(peer, index, decode_chunk(session.codec, payload, b - a), weight,
                                    finite_checked=True)
                session.changed.set()
            elif not late:  # sealed without it: a slow sender's chunk is only read
                dropped += 1
            k = index + 1

        def keeps_pace(index: int) -> Optional[float]:
            if late:
                return None
            now = loop.time()
            pace = (now - opened) / (index + 1)
            allowed = min(now + max(SLOW_SENDER_GRACE_S, SLOW_SENDER_PACES * pace),
                          opened + self.config.reducer_timeout_s)
            return max(session.deadline + 1.0, allowed)

        try:
            await request.read_frames(sizes, on_frame,
                                      loop.time() + self.config.reducer_timeout_s if late else session.deadline + 1.0,
                                      keeps_pace)
        except (RpcTimeout, Unreachable) as e:
            if late:  # its part no longer counts here: a late stream that breaks off is no offence
                raise Refused(f"late part not read: {e}", "timeout") from None
            if isinstance(e, Unreachable):
                return f"chunk {k} of {len(sizes)}: {type(e).__name__}: {e}"
            return (f"stalled: chunk {k} of {len(sizes)} not delivered within "
                    f"sender_timeout_s={self.config.sender_timeout_s}")
        except (ValueError, RpcError) as e:
            return f"chunk {k} of {len(sizes)}: {type(e).__name__}: {e}"
        finally:
            session.bytes_received += request.stream.bytes_received
        if late:  # its pace says nothing about our link: it started late
            return None
        if dropped:
            session.late.append(peer)
            logger.info("%s sent %d of %d chunks of group %s after sender_timeout_s=%s: left out of those, not "
                        "banned (slow, not stalled)", peer, dropped, len(sizes), session.group.group_id,
                        self.config.sender_timeout_s, extra={"event": "late_sender", "peer": peer})
        started = session.deadline - self.config.sender_timeout_s
        session.downloads.append((request.stream.bytes_received, asyncio.get_running_loop().time() - started))
        return None

    async def _answer(self, request: Request, session: _ReduceSession, reply_sizes: list[int]) -> None:
        """Write each sealed chunk's aggregate to the member, in order, as soon as it is sealed."""
        deadline = asyncio.get_running_loop().time() + self.config.reducer_timeout_s
        written = 0

        async def answer_in_order() -> None:
            nonlocal written
            for k in range(len(reply_sizes)):
                while len(session.sealed) <= k:
                    await session.sealed_event.wait()
                written += await request.reply_frame(k, reply_sizes, session.sealed[k])

        try:
            await until(answer_in_order(), deadline)  # one timer for the whole answer, not one per chunk
        except (asyncio.TimeoutError, RpcError) as e:
            logger.info("could not answer %s for group %s: %r", request.peer, session.group.group_id, e)
            return
        session.bytes_sent += written
        session.answers += 1
        session.answered.set()

    @staticmethod
    def _check_header(session: _ReduceSession, peer: str, header: dict, payload_length: int,
                      expected_length: int) -> Optional[str]:
        """None if the part header is acceptable, else the reason to exclude the sender."""
        if peer not in session.group.members:
            return "not a member of the group"
        if peer in session.reducer.delivered or peer in session.excluded or peer in session.late:
            return "sent its part twice"
        if header.get("codec") != session.codec.name:
            return f"codec {header.get('codec')!r} differs from the run's {session.codec.name!r}"
        if header.get("numel") != session.part_numel or isinstance(header.get("numel"), bool):
            return f"part of {header.get('numel')!r} elements, expected {session.part_numel}"
        problem = weight_problem(header.get("weight"))
        if problem:
            return problem
        if payload_length != expected_length:
            return f"payload of {payload_length} bytes, expected {expected_length}"
        return None
