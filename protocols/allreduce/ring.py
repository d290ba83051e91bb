"""A pipelined ring all-reduce (reduce-scatter then all-gather, Patarasuk & Yuan 2009; the pattern of NCCL's and
gloo's rings) for groups where it moves the same bytes faster than the butterfly.

Why: the butterfly has every member send to every other at once, so N-1 flows compete at each shaped link; on a
home link TCP then reaches 0.76-0.86 of its rate, where one long flow per link (a ring) reaches 0.91-0.93
(docs/benchmarks.md, "what TCP allows"). Each member sends and receives 2 (N-1)/N of the vector either way.

Protocol: an RPC method ``ring`` (handler ``<prefix>.ring``) beside the butterfly's ``reduce``. Members stand in
group order; member i opens one call to its right neighbour i+1 and serves one from its left neighbour i-1. The
request header is ``group_id``, ``numel``, ``codec``; the request is framed (:func:`protocols.rpc.call_framed`) as
2 (N-1) steps of the equal parts (:func:`protocols.partition.partition_sizes`) in frames sized to the group's
slowest announced link (:meth:`RingAllReduce.frame_numel`, :func:`protocols.partition.chunk_bounds`):

- reduce-scatter step s = 0 .. N-2: member i sends part (i - s) mod N, each chunk framed as the running weight
  W (fp64, little-endian: the sum of the weights folded in so far) followed by the running weighted mean m encoded
  by the codec. Step 0 is the member's own chunk (W = w_i, m = x_i); step s > 0 folds its own chunk into what the
  left neighbour sent at step s-1 for the same part: W = W' + w_i, m = m' + (w_i / W) (x_i - m') in fp32 (zeros
  while W = 0, as the butterfly's mean of zero weight).
- all-gather step s = 0 .. N-2: member i sends part (i + 1 - s) mod N. At step 0 that is the part it completed
  (it folded the last contribution in and encoded the mean once); at s > 0 it forwards the bytes its left neighbour
  sent at step s-1, unchanged.

Each frame is produced as soon as the frame it depends on arrived, so every link carries one pipelined flow. Every
member, the completing one included, decodes the same bytes of each part's mean: the averages are bit-identical
across members, as with the butterfly. The reply is empty, sent once the member processed the whole request.

What it gives up against the butterfly (why it is chosen per group, not always): no member sees another's own
contribution, so there is no per-sender validation, exclusion or CenteredClip (``aggregation = "mean"`` only) and
one failed member fails the round for all (the butterfly loses the part of a member that died, too); the running
mean is re-encoded at each hop, so only the float codecs (none, fp16, bf16) are allowed; every member is dialed by
its left neighbour, so a dial-only member (behind a NAT) is not placed in a ring; every link carries the same bytes,
so links of different speeds are better served by the butterfly's bandwidth-proportional parts, and only members
whose measured rates (announced in the group info after their first butterfly runs) are alike ring; every
:data:`RING_REMEASURE_RUNS` rings in a row a group runs the butterfly once, which measures the links again.
:meth:`RingAllReduce.ring_fits` decides, from the group alone (every member decides alike), and the butterfly runs
otherwise.

Failure semantics: anything that keeps a member from completing (a neighbour that died, refused, stalled past
``reducer_timeout_s``, or sent a frame of the wrong size, a non-finite value or a bad weight: that neighbour is
banned) raises :class:`AllReduceFailed`; the failure reaches the rest of the ring as its streams break.
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Union

import torch

from protocols.allreduce.aggregate import MAX_WEIGHT, prepare_local_input, prepare_out
from protocols.allreduce.butterfly import ButterflyAllReduce
from protocols.allreduce.chunks import decode_chunk, decode_chunk_into, encode_chunk
from protocols.allreduce.config import RING_CODECS, AllReduceFailed, AllReduceResult
from protocols.allreduce.parts import RATE_SPREAD, announced_rates
from protocols.matchmaking import Group
from protocols.partition import CHUNK_ALIGN, chunk_bounds, partition_sizes
from protocols.rpc import Refused, Request, RpcError, Service, call_framed
from protocols.wire import ProtocolViolation, require

logger = logging.getLogger("protocols.allreduce")

#: Smallest group that rings: with two members the ring and the butterfly move the same bytes in the same flows.
RING_MIN_MEMBERS = 3
#: A member that rang this many runs in a row announces it (``ringed`` in its group info) and its next group runs the
#: butterfly, whose streams measure the links again (a ring's flows all run at its slowest link's pace, so its own
#: runs measure nothing): a link that slowed down is noticed within this many runs, for one butterfly's time.
RING_REMEASURE_RUNS = 16
#: A ring frame holds what the group's slowest announced link moves in this many seconds (in the run's codec), at
#: most ``chunk_numel`` values: a frame waits for its predecessor's whole frame at every hop, so the pipeline's fill
#: and drain cost about a frame's time on the slowest link (once per run: the members send in step, so the wait
#: does not add up over the steps), while every frame costs the same CPU whatever its size. Measured at 100 Mbit/s
#: (docs/benchmarks.md, "The ring's CPU on a shaped link"): 10, 20 and 40 ms frames took the same time within the
#: run's noise (0.96-1.06 of plain TCP's ring at 4 peers), at 3.0, 2.2 and 1.4 CPU seconds for 4 peers' 25 MB fp32
#: (7.7, 4.3 and 3.5 for 8 peers, which at 10 ms kept both cores busy); announced rates are what a member measured
#: in a butterfly, below its link's, so 40 ms of them is ~30 ms on the link.
RING_FRAME_S = 0.04

_WEIGHT = struct.Struct("<d")


@dataclass(frozen=True)
class _Frame:
    """One frame of a member's request to its right neighbour: ``phase`` "rs" (reduce-scatter) or "ag"
    (all-gather), of ``part``, values ``[a, b)`` of that part."""

    phase: str
    part: int
    a: int
    b: int


def ring_plan(sender: int, n: int, sizes: list[int], chunk_numel: int) -> list[_Frame]:
    """The frames member ``sender`` of a ring of ``n`` sends its right neighbour, in order (see the module doc)."""
    frames = []
    for phase, first in (("rs", sender), ("ag", sender + 1)):
        for step in range(n - 1):
            part = (first - step) % n
            frames.extend(_Frame(phase, part, a, b) for a, b in chunk_bounds(sizes[part], chunk_numel))
    return frames


@dataclass
class _RingSession:
    """One group's ring as this member runs it."""

    left: str
    numel: int
    in_plan: list[_Frame]
    in_sizes: list[int]
    fold: Callable[[_Frame, Union[bytes, bytearray]], Optional[list]]
    """Makes the frame for the right neighbour from frame k of the left's (None: nothing to forward)."""
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    """Frames for the right neighbour made from the left's (payloads), or the exception that ends the ring."""
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """Set once every frame from the left was processed (result None) or the ring failed here (its exception)."""
    served: bool = False
    bytes_received: int = 0


class RingAllReduce(ButterflyAllReduce):
    """The butterfly service plus the ring: :meth:`run` rings the groups :meth:`ring_fits`, and runs the butterfly
    for the others. Selected by ``[averaging.allreduce] exchange = "ring"``; same constructor, :meth:`start`,
    :meth:`run`, :meth:`announce` and :attr:`codec` as :class:`ButterflyAllReduce`.

    Raises ValueError at construction unless ``aggregation = "mean"`` and the codec is one of :data:`RING_CODECS`
    (:class:`protocols.allreduce.AllReduceConfig` checks the same).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.config.aggregation != "mean" or self.codec.name not in RING_CODECS:
            raise ValueError(f"the ring all-reduce needs aggregation = 'mean' and a codec of {RING_CODECS}, got "
                             f"{self.config.aggregation!r} and {self.codec.name!r}")
        self._rings: dict[str, _RingSession] = {}
        self._ring_ready: dict[str, asyncio.Event] = {}
        self.rings_run = 0
        """Runs that took the ring (the others took the butterfly)."""
        self.ringed = 0
        """Runs in a row that took the ring (announced: see :data:`RING_REMEASURE_RUNS`)."""
        self.remeasure_runs = RING_REMEASURE_RUNS

    def stream_handler(self, method: str):
        if method == "ring":
            return Service.stream_handler(self, method)
        return super().stream_handler(method)

    def announce(self) -> dict:
        """The butterfly's group-info entries plus ``ringed``: this member's runs in a row that took the ring."""
        return {**super().announce(), "ringed": self.ringed}

    def ring_fits(self, group: Group, numel: int) -> bool:
        """Whether ``group`` rings (every member decides alike, from the group alone): at least
        :data:`RING_MIN_MEMBERS` members and ``numel`` values, no member announced ``dial_only``, and every member
        announced its link rates (:meth:`announce`: measured by its butterfly runs, so a peer's first runs are
        butterflies) within :data:`RATE_SPREAD` of each other: links of one speed, where the butterfly too would cut
        equal parts. A ring's own runs measure no rates (each of its flows runs at the pace of the ring's slowest
        link), so the rates a member announces stay those of its last butterfly runs, and a group with a member that
        announced :attr:`remeasure_runs` (:data:`RING_REMEASURE_RUNS`) rings in a row (``ringed``) runs the butterfly
        once, to measure them again."""
        members = group.members
        if len(members) < RING_MIN_MEMBERS or numel < len(members):
            return False
        infos = group.infos if isinstance(group.infos, dict) else {}
        for member in members:
            info = infos.get(member)
            if not isinstance(info, dict) or info.get("dial_only") is True:
                return False
            ringed = info.get("ringed", 0)
            if not isinstance(ringed, int) or isinstance(ringed, bool) or not 0 <= ringed < self.remeasure_runs:
                return False
        rates = announced_rates(group.members, infos)
        return rates is not None and min(rates) > 0 and max(rates) <= RATE_SPREAD * min(rates)

    def frame_numel(self, group: Group) -> int:
        """Values per frame of ``group``'s ring (every member computes the same): what its slowest announced link
        moves in :data:`RING_FRAME_S`, rounded down to a multiple of 4096, in ``[4096, chunk_numel]``; call only for a
        group that :meth:`ring_fits`."""
        rates = announced_rates(group.members, group.infos) or [0.0]
        per_value = self.codec.encoded_size(CHUNK_ALIGN) / CHUNK_ALIGN
        numel = int(min(rates) * RING_FRAME_S / per_value) // CHUNK_ALIGN * CHUNK_ALIGN
        return max(CHUNK_ALIGN, min(self.config.chunk_numel, numel))

    async def run(self, group: Group, tensor: torch.Tensor, weight: float,
                  out: Optional[torch.Tensor] = None) -> AllReduceResult:
        """Average ``tensor`` (P,) fp32 with the group, weighted by ``weight``: by the ring where
        :meth:`ring_fits`, else by the butterfly. ``out`` as :meth:`ButterflyAllReduce.run` (in the ring too a
        region's own values are folded in before its mean can come back). Raises :class:`AllReduceFailed`;
        ValueError on bad local input."""
        if not self.ring_fits(group, tensor.numel()):
            result = await super().run(group, tensor, weight, out)
            self.ringed = 0
            return result
        result = await self._ring(group, tensor, weight, out)
        self.ringed += 1
        return result

    async def _ring(self, group: Group, tensor: torch.Tensor, weight: float,
                    out: Optional[torch.Tensor] = None) -> AllReduceResult:
        me = self.transport.streams.peer_id
        tensor, weight = prepare_local_input(group, me, tensor, weight)
        out = prepare_out(out, tensor, self.codec.sparse)
        loop = asyncio.get_running_loop()
        start, cpu_start = loop.time(), time.process_time()
        deadline = start + self.config.reducer_timeout_s
        n, i, numel = len(group.members), group.members.index(me), tensor.numel()
        sizes = partition_sizes(numel, n)
        offsets = [sum(sizes[:p]) for p in range(n)]
        left, right = group.members[(i - 1) % n], group.members[(i + 1) % n]
        chunk = self.frame_numel(group)
        out_plan, in_plan = ring_plan(i, n, sizes, chunk), ring_plan((i - 1) % n, n, sizes, chunk)
        averaged = torch.empty_like(tensor) if out is None else out
        codec = self.codec

        def values(frame: _Frame, of: torch.Tensor = tensor) -> torch.Tensor:
            return of[offsets[frame.part] + frame.a: offsets[frame.part] + frame.b]

        def frame_size(frame: _Frame) -> int:
            return codec.encoded_size(frame.b - frame.a) + (_WEIGHT.size if frame.phase == "rs" else 0)

        def own_encoding(chunk: torch.Tensor) -> Union[bytes, memoryview]:
            """``chunk`` (finite fp32) encoded by the codec; AllReduceFailed where it overflows the codec's range
            (bf16: beyond fp32's range after rounding)."""
            try:
                return encode_chunk(codec, chunk, checked=True)
            except ValueError as e:
                raise AllReduceFailed(f"could not encode our running mean: {e}") from None

        def fold(frame: _Frame, payload: Union[bytes, bytearray]) -> Optional[list]:
            """Process frame ``frame`` from the left; returns the frame it makes for the right (None: the last
            all-gather step, forwarded nowhere). Raises ValueError on a frame that is not a valid one."""
            if frame.phase == "ag":
                decode_chunk_into(codec, payload, values(frame, averaged))
                return None if frame.part == (i + 2) % n else [payload]
            (before,) = _WEIGHT.unpack_from(payload, 0)
            if not (math.isfinite(before) and 0 <= before <= MAX_WEIGHT * (n - 1)):
                raise ValueError(f"running weight {before!r} is not in [0, {MAX_WEIGHT * (n - 1):g}]")
            mean = decode_chunk(codec, memoryview(payload)[_WEIGHT.size:], frame.b - frame.a)
            total = before + weight
            mine = values(frame)
            folded = torch.lerp(mean.float(), mine, weight / total) if total > 0 else torch.zeros_like(mine)
            encoded = own_encoding(folded)
            if frame.part == (i + 1) % n:  # the last contribution: this part's mean, the same bytes for everyone
                decode_chunk_into(codec, encoded, values(frame, averaged), trusted=codec.name == "none")
                return [encoded]
            return [_WEIGHT.pack(total), encoded]

        session = _RingSession(left, numel, in_plan, [frame_size(f) for f in in_plan], fold)
        self._rings[group.group_id] = session
        self._ring_ready.setdefault(group.group_id, asyncio.Event()).set()

        async def frames() -> AsyncIterator[list]:
            for frame in out_plan:
                if frame.phase != "rs" or frame.part != i:
                    break
                yield [_WEIGHT.pack(weight), own_encoding(values(frame))]
            for _ in range(len(out_plan) - len(chunk_bounds(sizes[i], chunk))):
                item = await session.outbox.get()
                if isinstance(item, BaseException):
                    raise AllReduceFailed(f"the ring broke at {left}: {item}") from item
                yield item

        sender = asyncio.ensure_future(call_framed(
            self.transport.streams, right, self.prefix, "ring",
            {"group_id": group.group_id, "numel": numel, "codec": codec.name},
            frames(), [frame_size(f) for f in out_plan], [0], lambda k, p: None,
            timeout_s=max(deadline - loop.time(), 0.0)))
        # where the left side's failure is the one raised, the call's own (the same failure, relayed) is not
        sender.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            await asyncio.wait({session.done, sender}, timeout=max(deadline - loop.time(), 0.0),
                               return_when=asyncio.FIRST_EXCEPTION)
            if session.done.done() and session.done.exception() is not None:
                raise session.done.exception()
            if not sender.done() or not session.done.done():
                raise AllReduceFailed(f"the ring did not complete within reducer_timeout_s (left {left} "
                                      f"{'called' if session.served else 'never called'})")
            try:
                _, sent, received = sender.result()
            except RpcError as e:
                raise self.call_failed(f"right neighbour {right}", e) from e
        finally:
            sender.cancel()
            if not session.done.done():
                session.done.set_exception(AllReduceFailed("this member gave up on the ring"))
                session.done.exception()  # retrieved: nobody else may wait for it
            self._rings.pop(group.group_id, None)
            self._ring_ready.pop(group.group_id, None)
        self.rings_run += 1
        seconds = loop.time() - start
        logger.info("ring all-reduce of group %s (%s) done: %d members", group.group_id, group.key, n,
                    extra={"event": "allreduce", "group_id": group.group_id, "key": group.key, "group_size": n,
                           "part_numel": sizes[i], "cpu_s": time.process_time() - cpu_start, "pattern": "ring"})
        return AllReduceResult(averaged, n, sent, received + session.bytes_received, seconds, n, {}, None,
                               tuple(sizes), ())

    async def rpc_ring(self, request: Request) -> None:
        """Serve our left neighbour's call: fold each of its frames into ours for the right neighbour as it arrives;
        answer (empty) once all are processed. Refuses a caller that is not our left neighbour in a ring we run, a
        header that does not match the ring, and (banning the caller) a frame that is not valid."""
        peer, header = request.peer, request.header
        group_id = require(header, "group_id", str)
        ready = self._ring_ready.setdefault(group_id, asyncio.Event())
        try:
            await asyncio.wait_for(ready.wait(), self.config.sender_timeout_s)
            session = self._rings[group_id]
        except (asyncio.TimeoutError, KeyError):
            if group_id not in self._rings:
                self._ring_ready.pop(group_id, None)
            raise Refused(f"no ring of group {group_id} here") from None
        if peer != session.left or session.served:
            raise Refused(f"{peer} is not this member's left neighbour in group {group_id}")
        if header.get("numel") != session.numel or header.get("codec") != self.codec.name:
            raise Refused(f"ring header {header.get('numel')!r} values, codec {header.get('codec')!r} does not match "
                          f"{session.numel} values, codec {self.codec.name!r}")
        session.served = True
        plan = session.in_plan

        def on_frame(k: int, payload: Union[bytes, bytearray]) -> None:
            if session.done.done():  # our run gave up (or failed): stop the left's sending
                raise Refused("this member left the ring")
            made = session.fold(plan[k], payload)
            if made is not None:
                session.outbox.put_nowait(made)

        deadline = asyncio.get_running_loop().time() + self.config.reducer_timeout_s
        try:
            await request.read_frames(session.in_sizes, on_frame, deadline)
        except ValueError as e:  # fold refused a frame: a faulty or hostile neighbour
            self.bans.ban(peer, f"sent an invalid ring frame: {e}")
            self._fail(session, e)
            raise Refused(f"invalid ring frame: {e}") from None
        except AllReduceFailed as e:  # our own encoding failed
            self._fail(session, e)
            raise Refused(str(e)) from None
        except (RpcError, ProtocolViolation) as e:
            self._fail(session, e)
            raise
        session.bytes_received = request.stream.bytes_received
        if not session.done.done():
            session.done.set_result(None)

    @staticmethod
    def _fail(session: _RingSession, error: BaseException) -> None:
        """The left side of the ring broke: wake the frames waiting for it and the run."""
        session.outbox.put_nowait(error)
        if not session.done.done():
            session.done.set_exception(AllReduceFailed(f"left neighbour {session.left}: {error}"))
            session.done.exception()  # marked retrieved: the run may have ended already
