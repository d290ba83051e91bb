"""Butterfly all-reduce of one fp32 vector with sample weights (Zhao & Canny 2013; the scheme of hivemind's averager).

The N members of a sealed group each split the vector (P,) into N contiguous parts. Member i is the *reducer* of
part i: every member sends it part i (encoded by the run's codec), it computes the weighted mean
``sum_j w_j x_j / sum_j w_j`` in fp32, encodes that mean once, and sends the *same bytes* back to every member.
Every member, the reducer included, decodes those bytes: all members end with bit-identical averages, which is what
lets DiLoCo peers keep bit-identical theta_outer. Each member sends and receives about 2 (N-1)/N of the vector.

Sparse codecs (``compression = "topk"``, SparseLoCo, arXiv 2508.15706): members' top-k selections have different
indices, so a reducer cannot average encoded parts, and the mean of N sparse parts (up to N k values, not 2-bit) is
not representable in the sparse codec. SparseLoCo all-gathers the sparse tensors instead; peerd keeps the butterfly:
each reducer decodes every member's sparse part densely, averages in fp32 as for any codec, and answers with the mean
encoded by a *dense* codec (``result_compression``, fp16 by default). This keeps the reducer fault handling and the
bit-identical guarantee unchanged (every member decodes the same answer bytes) and costs each member about (N-1)/N of
the vector sparse up plus (N-1)/N dense down, independent of N, where a gather costs N-1 sparse vectors each way.
The sender's error feedback needs what its own contribution decoded to: :attr:`AllReduceResult.sent`.

Failure semantics:
- a sender that does not deliver its part within ``sender_timeout_s`` is left out of that part's mean;
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
from dataclasses import dataclass, field
from typing import Optional

import torch

from protocols.bans import BanList
from protocols.codecs import Codec, all_finite, get_codec
from protocols.interfaces import StreamReader, StreamWriter, Transport
from protocols.matchmaking import Group
from protocols.robust import AGGREGATIONS, centered_clip
from protocols.rpc import Refused, Request, RpcError, RpcTimeout, Service, call
from protocols.wire import ProtocolViolation, require

logger = logging.getLogger(__name__)

#: Largest weight (samples) a member may claim for one round.
MAX_WEIGHT = 1e12


# ---------------------------------------------------------------------------------------------------------- pure core


def partition_sizes(numel: int, n_parts: int) -> list[int]:
    """Split ``numel`` elements into ``n_parts`` contiguous parts whose sizes differ by at most one."""
    if n_parts < 1 or numel < 0:
        raise ValueError(f"need n_parts >= 1 and numel >= 0, got {n_parts}, {numel}")
    base, extra = divmod(numel, n_parts)
    return [base + (1 if i < extra else 0) for i in range(n_parts)]


def validate_weight(weight: float) -> float:
    """A member's weight must be finite and in [0, MAX_WEIGHT]; returns it as float or raises ValueError."""
    weight = float(weight)
    if not math.isfinite(weight) or weight < 0 or weight > MAX_WEIGHT:
        raise ValueError(f"weight must be finite and in [0, {MAX_WEIGHT:g}], got {weight}")
    return weight


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


# ------------------------------------------------------------------------------------------------------------ runner


@dataclass(frozen=True)
class AllReduceConfig:
    """Wire format and timeouts (seconds) of one all-reduce."""

    compression: str = "fp16"
    """Codec for parts (and, if dense, results) on the wire: none | fp16 | bf16 | int8 | fp4 | topk."""
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
    """How many members contributed to this peer's own part (its reducer view)."""
    excluded: dict[str, str] = field(default_factory=dict)
    """Members whose part this peer refused as reducer, with the reason."""
    sent: Optional[torch.Tensor] = None
    """(P,) fp32: what this member's contribution decoded to at the reducers; set for sparse codecs only (for
    :class:`protocols.codecs.ErrorFeedback`)."""


@dataclass
class _ReduceSession:
    group: Group
    part_numel: int
    codec: Codec
    reducer: PartReducer
    deadline: float
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    result_bytes: Optional[bytes] = None
    excluded: dict[str, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    answers: int = 0
    answered: asyncio.Event = field(default_factory=asyncio.Event)


class ButterflyAllReduce(Service):
    """Runs butterfly all-reduces for groups formed by :class:`protocols.matchmaking.Matchmaker`.

    An RPC service (:mod:`protocols.rpc`) named ``prefix`` with one method, ``reduce`` (stream handler
    ``<prefix>.reduce``): a member's request carries its slice of our part (header ``group_id``, ``numel``,
    ``weight``, ``codec``), the reply carries the encoded mean of the part. Call :meth:`start` once, then :meth:`run`
    once per group.
    """

    def __init__(self, transport: Transport, prefix: str, config: AllReduceConfig, bans: Optional[BanList] = None):
        self.transport = transport
        self.prefix = self.name = prefix
        self.config = config
        self.request_timeout_s = config.sender_timeout_s  # a sender stalled inside its header is banned
        self.bans = bans if bans is not None else BanList()
        self.codec = get_codec(config.compression)
        result = config.result_compression
        if result == "auto":
            result = "fp16" if self.codec.sparse else config.compression
        self.result_codec = get_codec(result)
        self._sessions: dict[str, _ReduceSession] = {}
        self._session_ready: dict[str, asyncio.Event] = {}

    @property
    def handler_name(self) -> str:
        return self.handler_name_of("reduce")

    def stream_handler(self, method: str):
        return self._handle_part  # a seam: tests wrap the reducer's side of a member's stream

    async def _handle_part(self, peer: str, reader: StreamReader, writer: StreamWriter) -> None:
        await self.serve("reduce", peer, reader, writer)

    async def run(self, group: Group, tensor: torch.Tensor, weight: float) -> AllReduceResult:
        """Average ``tensor`` (P,) fp32 with the group, weighted by ``weight`` (e.g. samples processed).

        Every member must call this with the same group and the same P. Raises :class:`AllReduceFailed` if any part's
        mean could not be obtained within ``reducer_timeout_s``; ValueError on bad local input.
        """
        me = self.transport.streams.peer_id
        weight = validate_weight(weight)
        if tensor.dtype != torch.float32 or tensor.dim() != 1:
            raise ValueError(f"tensor must be 1-D float32, got {tensor.dtype} {tuple(tensor.shape)}")
        if me not in group.members:
            raise ValueError("this peer is not a member of the group")
        loop = asyncio.get_running_loop()
        start = loop.time()
        sizes = partition_sizes(tensor.numel(), len(group.members))
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        my_index = group.members.index(me)
        tensor = tensor.detach().cpu().contiguous()

        session = _ReduceSession(
            group, sizes[my_index], self.codec,
            PartReducer(sizes[my_index], self.config.aggregation, self.config.clip_tau),
            start + self.config.sender_timeout_s,
        )
        for member in group.members:  # do not wait for parts we would refuse anyway
            if member != me and self.bans.is_banned(member):
                session.excluded[member] = f"banned: {self.bans.reason(member)}"
        self._sessions[group.group_id] = session
        self._session_ready.setdefault(group.group_id, asyncio.Event()).set()
        own = tensor[offsets[my_index] : offsets[my_index] + sizes[my_index]]
        own_sent = self.codec.decode(self.codec.encode(own), own.numel())
        session.reducer.add(me, own_sent, weight)
        finisher = asyncio.ensure_future(self._finish_when_complete(session))
        averaged = torch.empty_like(tensor)
        try:
            calls = [
                self._exchange(peer, group, tensor[offsets[i] : offsets[i] + sizes[i]], weight, start)
                for i, peer in enumerate(group.members)
                if peer != me
            ]
            results = await asyncio.gather(finisher, *calls, return_exceptions=True)
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                raise AllReduceFailed(f"{len(failures)} part(s) missing: {failures[0]!r}") from failures[0]
            sent = received = 0
            others = iter(results[1:])
            for i, peer in enumerate(group.members):
                if peer == me:
                    part = self.result_codec.decode(session.result_bytes, sizes[i])
                else:
                    part, b_sent, b_received = next(others)
                    sent, received = sent + b_sent, received + b_received
                averaged[offsets[i] : offsets[i] + sizes[i]] = part
            sent_parts = None
            if self.codec.sparse:
                sent_parts = torch.cat([own_sent if peer == me else self.codec.decode(
                    self.codec.encode(tensor[offsets[i] : offsets[i] + sizes[i]]), sizes[i])
                    for i, peer in enumerate(group.members)])
            await self._wait_answers_written(session)
            logger.info("all-reduce of group %s (%s) done: %d members", group.group_id, group.key, len(group.members),
                        extra={"event": "allreduce", "group_id": group.group_id, "key": group.key,
                               "group_size": len(group.members)})
            return AllReduceResult(
                averaged,
                len(group.members),
                sent + session.bytes_sent,
                received + session.bytes_received,
                loop.time() - start,
                len(session.reducer.contributors),
                dict(session.excluded),
                sent_parts,
            )
        finally:
            finisher.cancel()
            if session.result_bytes is None:  # we failed before our part was sealed: answer what we have
                session.result_bytes = self.result_codec.encode(session.reducer.mean())
                session.finished.set()
            asyncio.get_running_loop().call_later(
                self.config.reducer_timeout_s, self._forget, group.group_id
            )

    async def _wait_answers_written(self, session: _ReduceSession, grace_s: float = 2.0) -> None:
        """Let our answers to the other contributors finish (briefly), so the byte counts are complete."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while session.answers < len(session.reducer.contributors) - 1 and loop.time() < deadline:
            session.answered.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(session.answered.wait(), deadline - loop.time())

    def _forget(self, group_id: str) -> None:
        self._sessions.pop(group_id, None)
        self._session_ready.pop(group_id, None)

    async def _finish_when_complete(self, session: _ReduceSession) -> None:
        """Seal this peer's part once every member contributed or the sender timeout passed."""
        loop = asyncio.get_running_loop()
        expected = len(session.group.members)
        while len(session.reducer.contributors) + len(session.excluded) < expected:
            remaining = session.deadline - loop.time()
            if remaining <= 0:
                missing = set(session.group.members) - set(session.reducer.contributors) - set(session.excluded)
                # senders that never connected are dead or failed locally: no ban (the next round may have them back);
                # a sender that connected but stalled mid-part is banned in _handle_part
                logger.info("averaging part without %d late sender(s): %s", len(missing), sorted(missing))
                break
            session.arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(session.arrived.wait(), remaining)
        session.result_bytes = self.result_codec.encode(session.reducer.mean())
        session.finished.set()

    async def _exchange(
        self, peer: str, group: Group, part: torch.Tensor, weight: float, start: float
    ) -> tuple[torch.Tensor, int, int]:
        """Send our slice of ``peer``'s part; returns that part's mean (decoded) and the bytes sent and received."""
        loop = asyncio.get_running_loop()
        timeout = start + self.config.reducer_timeout_s - loop.time()
        header = {"group_id": group.group_id, "numel": part.numel(), "weight": weight, "codec": self.codec.name}
        try:
            reply = await call(self.transport.streams, peer, self.prefix, "reduce", header, self._encode_part(part),
                               timeout_s=max(timeout, 0.0),
                               max_reply_bytes=self.result_codec.encoded_size(part.numel()))
        except RpcTimeout:
            raise AllReduceFailed(f"reducer {peer} did not answer within reducer_timeout_s") from None
        except Refused as e:
            raise AllReduceFailed(f"reducer {peer} refused our part: {e.reason}") from e
        except RpcError as e:
            raise AllReduceFailed(f"reducer {peer} failed: {e!r}") from e
        try:
            averaged = self.result_codec.decode(reply.payload, part.numel())
        except ValueError as e:  # wrong size or non-finite values: a faulty or hostile reducer
            self.bans.ban(peer, f"sent an invalid mean: {e}")
            raise AllReduceFailed(f"reducer {peer} failed: sent an invalid mean: {e}") from None
        return averaged, reply.bytes_sent, reply.nbytes

    def _encode_part(self, part: torch.Tensor) -> bytes:
        """Encode our slice of another member's part (a seam for fault-injection tests)."""
        return self.codec.encode(part)

    def on_bad_request(self, peer: str, method: str, error: RpcError) -> None:
        """Garbage (or a stall) before we even know the part's group: ban the sender, exclude it everywhere."""
        if isinstance(error, RpcTimeout):  # connected, then stalled inside its header: as bad as a malformed one
            error = ProtocolViolation(f"part header not delivered within sender_timeout_s={self.config.sender_timeout_s}")
        logger.warning("dropped a part from %s: %r", peer, error)
        self.bans.ban(peer, f"malformed part header: {error}")
        for other in self._sessions.values():
            if peer in other.group.members and peer not in other.reducer.contributors:
                other.excluded.setdefault(peer, f"malformed part header: {error}")
                other.arrived.set()

    async def rpc_reduce(self, request: Request) -> None:
        """Serve one member's part of our reduction: validate, accumulate, answer with the encoded mean."""
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
        reason = self._check_header(session, peer, header, request.size)
        if reason is None and self.bans.is_banned(peer):
            reason = f"banned: {self.bans.reason(peer)}"
        if reason is None:
            try:
                budget = max(session.deadline - asyncio.get_running_loop().time(), 0.0) + 1.0
                expected = session.codec.encoded_size(session.part_numel)
                payload = await request.payload(expected, budget)
                session.bytes_received += request.stream.bytes_received
                if session.result_bytes is None:
                    session.reducer.add(peer, session.codec.decode(payload, session.part_numel), header["weight"])
            except RpcTimeout:
                reason = f"stalled: part not delivered within sender_timeout_s={cfg.sender_timeout_s}"
            except (ValueError, RpcError) as e:
                reason = f"{type(e).__name__}: {e}"
        if reason is not None:
            session.excluded[peer] = reason
            self.bans.ban(peer, reason)
            session.arrived.set()
            logger.warning("excluded %s from group %s: %s", peer, session.group.group_id, reason,
                           extra={"event": "exclude", "peer": peer, "reason": reason})
            raise Refused(reason)
        session.arrived.set()
        try:
            await asyncio.wait_for(session.finished.wait(), cfg.reducer_timeout_s)
            written = await request.reply({}, session.result_bytes)
        except (asyncio.TimeoutError, RpcError) as e:
            logger.info("could not answer %s for group %s: %r", peer, session.group.group_id, e)
            return
        session.bytes_sent += written
        session.answers += 1
        session.answered.set()

    @staticmethod
    def _check_header(session: _ReduceSession, peer: str, header: dict, payload_length: int) -> Optional[str]:
        """None if the part header is acceptable, else the reason to exclude the sender."""
        if peer not in session.group.members:
            return "not a member of the group"
        if peer in session.reducer.contributors or peer in session.excluded:
            return "sent its part twice"
        if header.get("codec") != session.codec.name:
            return f"codec {header.get('codec')!r} differs from the run's {session.codec.name!r}"
        if header.get("numel") != session.part_numel or isinstance(header.get("numel"), bool):
            return f"part of {header.get('numel')!r} elements, expected {session.part_numel}"
        weight = header.get("weight")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool):
            return "weight is not a number"
        try:
            validate_weight(weight)
        except ValueError as e:
            return str(e)
        if payload_length != session.codec.encoded_size(session.part_numel):
            return f"payload of {payload_length} bytes, expected {session.codec.encoded_size(session.part_numel)}"
        return None
