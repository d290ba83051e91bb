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

The package, one concept a module: :mod:`~protocols.allreduce.butterfly` (the service and the member's side of a
run), :mod:`~protocols.allreduce.reducer` (the reducer's side: reading parts, sealing, answering),
:mod:`~protocols.allreduce.session` (one group's reduction state), :mod:`~protocols.allreduce.parts` (part sizes and
link rates), :mod:`~protocols.allreduce.chunks` (a part's chunks on the wire), :mod:`~protocols.allreduce.aggregate`
(the fp32 aggregation of a part), :mod:`~protocols.allreduce.ring` (the pipelined ring that ``exchange = "ring"``
runs where the group suits it) and :mod:`~protocols.allreduce.config`.
"""

from protocols.allreduce.aggregate import (
    MAX_WEIGHT, ChunkedPartReducer, PartReducer, prepare_local_input, validate_weight, weight_problem,
)
from protocols.allreduce.butterfly import ButterflyAllReduce
from protocols.allreduce.chunks import decode_chunk, decode_chunk_into, encode_chunk
from protocols.allreduce.config import (
    EXCHANGES, PARTITIONS, RING_CODECS, AllReduceConfig, AllReduceFailed, AllReduceResult,
)
from protocols.allreduce.parts import (
    MIN_SHARE, RATE_HISTORY, RATE_MIN_BYTES, RATE_MIN_RUNS, RATE_MIN_STREAM_BYTES, RATE_SPREAD, PartPlanner,
)
from protocols.allreduce.reducer import SLOW_SENDER_GRACE_S, SLOW_SENDER_PACES
from protocols.allreduce.ring import RING_FRAME_S, RING_MIN_MEMBERS, RING_REMEASURE_RUNS, RingAllReduce
from protocols.partition import partition_sizes

__all__ = [
    "EXCHANGES", "MAX_WEIGHT", "MIN_SHARE", "PARTITIONS", "RATE_HISTORY", "RATE_MIN_BYTES", "RATE_MIN_RUNS",
    "RATE_MIN_STREAM_BYTES", "RATE_SPREAD", "RING_CODECS", "RING_FRAME_S", "RING_MIN_MEMBERS", "RING_REMEASURE_RUNS",
    "SLOW_SENDER_GRACE_S", "SLOW_SENDER_PACES", "AllReduceConfig", "AllReduceFailed", "AllReduceResult",
    "ButterflyAllReduce", "ChunkedPartReducer", "PartPlanner", "PartReducer", "RingAllReduce", "decode_chunk",
    "decode_chunk_into", "encode_chunk", "partition_sizes", "prepare_local_input", "validate_weight",
    "weight_problem",
]
