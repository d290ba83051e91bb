"""What an all-reduce is configured with and what it returns: :class:`AllReduceConfig`, :class:`AllReduceResult`,
:class:`AllReduceFailed`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from protocols.codecs import Codec, TopKCompression, get_codec
from protocols.partition import CHUNK_ALIGN, CHUNK_NUMEL
from protocols.robust import AGGREGATIONS

if TYPE_CHECKING:
    from protocols.matchmaking import Group

logger = logging.getLogger("protocols.allreduce")


#: Partition modes: ``equal`` parts, or ``bandwidth``-proportional ones where every member announced its rates.
PARTITIONS = ("equal", "bandwidth")
#: How members combine their vectors: the butterfly ``reduce``, ``gather`` (sparse codecs only), or ``ring`` (a
#: pipelined ring where the group suits it, the butterfly otherwise).
EXCHANGES = ("reduce", "gather", "ring")
#: Codecs the ring re-encodes its running mean with at every hop (float roundings only).
RING_CODECS = ("none", "fp16", "bf16")


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
    """reduce | gather | ring. reduce: the butterfly all-reduce (:mod:`protocols.allreduce`). gather: every member
    sends its encoded vector to every other and all sum the same bytes (:class:`protocols.allgather.SparseAllGather`,
    SparseLoCo); needs a sparse ``compression`` (topk) and ``aggregation = "mean"``. ring: a pipelined ring
    reduce-scatter + all-gather (:class:`protocols.allreduce.RingAllReduce`: one flow per link, ~10% faster than the
    butterfly's all-to-all on shaped home links) for groups of 3+ members whose measured link rates are alike and
    that have no member behind a NAT, the butterfly for the others (and for a peer's first runs, which measure its
    rates); needs ``aggregation = "mean"`` and a float ``compression`` (none, fp16, bf16): the ring has no
    per-sender validation and re-encodes its running mean at every hop."""

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
        if self.exchange == "ring" and (self.aggregation != "mean" or self.compression not in RING_CODECS):
            raise ValueError(f"exchange = 'ring' needs aggregation = 'mean' and a compression of {RING_CODECS}, got "
                             f"{self.aggregation!r} and {self.compression!r}: a ring member never sees another's "
                             "own part, and re-encodes the running mean at every hop")


    def make_codec(self) -> Codec:
        """The codec of ``compression``, with ``topk_fraction`` for ``topk``."""
        if self.compression == "topk":
            return TopKCompression(self.topk_fraction)
        return get_codec(self.compression)


class AllReduceFailed(Exception):
    """This peer did not obtain every part's mean; it must not use the result."""


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

    @classmethod
    def alone(cls, group: Group, tensor: torch.Tensor, sparse: bool) -> "AllReduceResult":
        """The result of ``group`` of one member: its own ``tensor`` ((P,) fp32, as checked by
        :func:`protocols.allreduce.prepare_local_input`), exactly and without a copy. A codec compresses what travels
        and nothing does, so there is no codec round trip (for fp16 it cost 12P bytes of host memory and two passes
        over P values at the round boundary); ``sent`` is ``tensor`` too for a sparse codec (the error feedback
        records no error: everything was delivered). Logged as every all-reduce's result is (event ``allreduce``)."""
        logger.info("all-reduce of group %s (%s) done: alone, nothing to average", group.group_id, group.key,
                    extra={"event": "allreduce", "group_id": group.group_id, "key": group.key, "group_size": 1,
                           "part_numel": tensor.numel(), "cpu_s": 0.0})
        return cls(tensor, 1, 0, 0, 0.0, 1, {}, tensor if sparse else None, (tensor.numel(),))
