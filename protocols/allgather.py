"""Sparse all-gather of top-k pseudo-gradients (SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706, section 3).

Why a gather and not a reduce: every member's top-k selection (:class:`protocols.codecs.TopKCompression`) has its
own indices, so the sum of N sparse vectors has up to N k non-zeros and is no longer a k-sparse, 2-bit vector. The
butterfly all-reduce (:mod:`protocols.allreduce`) therefore answers with a *dense* mean, and the dense answers
dominate its bytes. Here every member instead sends its own encoded top-k vector (indices + 2-bit values + per-chunk
magnitudes, exactly :meth:`~protocols.codecs.Codec.encoded_size` bytes) to every other member, and every member
decodes the same bytes and sums them in the same order (group member order, fp32, one rounded multiply and one
rounded add per value: no fused multiply-add, so the bits do not depend on the CPU): the averages are bit-identical
across members without any answer travelling. Each member sends and receives (N-1) sparse vectors, ~2.6% of fp32
at the default 2% density, where the butterfly with fp16 answers costs (N-1)/N sparse up plus (N-1)/N fp16 down.
Past N ~ 20 the butterfly's dense answers become the cheaper way (SparseLoCo's production run gathers 20 peers).

Protocol: an RPC service (:mod:`protocols.rpc`) named ``prefix`` with one method, ``gather`` (handler
``<prefix>.gather``). A member calls every other member once; the request header is ``group_id``, ``numel``,
``weight`` (samples) and ``codec``, the payload its encoded vector. The callee validates it (member of the group,
first call, codec, numel, weight, payload size: all *before* reading a byte of it; then the decode: indices in
range and increasing, finite magnitudes), keeps it, and answers once its own collection is over (every member's
vector in, or refused, or ``sender_timeout_s`` passed) with ``have``: ``{member: digest}`` of every vector it
accepted, the digest covering the weight and the payload bytes.

Agreement on who counts: a member sums the vectors of the members it accepted *and* that every answer it received
lists with the same digest. So a member that died mid-gather (its vector reached some members, not others), a
sender that was late at one member, or one that sent different bytes or weights to different members is left out
by everyone who heard every answer, and the sums stay identical. A member left out this way (itself included) has
:attr:`AllReduceResult.sent` all zero, so its error feedback keeps the whole vector for the next round.

Failure semantics:
- a vector that is malformed or oversized, or a header that is, excludes its sender (reported in
  :attr:`AllReduceResult.excluded`, banned in the ban list, refused); a vector whose stream breaks (the connection
  reset or lost: a crash, a dropped link, the path) excludes its sender from this round without a ban;
- a member that refuses our vector fails our round (:class:`AllReduceFailed`: we cannot know its view), as a
  reducer's refusal fails a butterfly round;
- a member that never answers (dead), or had not started this gather within ``sender_timeout_s`` of our call
  (refusal code ``unavailable``), is left out; its view does not constrain ours; once our call to it broke off
  (unreachable) we stop waiting for its vector, so a member dead before it sent holds no collection until
  ``sender_timeout_s`` (should its vector still arrive first, it counts as usual);
- a member that heard the view of a member that did not hear its own, and lacks a vector that every view it heard
  lists, fails its round (:class:`AllReduceFailed`): that member may count the vector, so the sums could differ
  (a member that started late ends here);
- a member that starts after our collection ended is late, not stalled: its vector is read and left out, and it
  receives our final view;
- a live member that lost an answer while another member did not can end with another sum (two faults in one
  round): its theta_outer digest then differs and the next matchmaking makes it download the state, as after any
  failed round.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from protocols.allreduce import (AllReduceConfig, AllReduceFailed, AllReduceResult, prepare_local_input,
                                 weight_problem)
from protocols.bans import BanList
from protocols.interfaces import Transport
from protocols.matchmaking import Group
from protocols.rpc import Refused, Request, RpcError, RpcTimeout, Service, Unreachable, call
from protocols.wire import ProtocolViolation, require

logger = logging.getLogger(__name__)

__all__ = ["SparseAllGather", "vector_digest"]


def vector_digest(weight: float, payload: bytes) -> str:
    """16 hex digits of SHA-256 over the weight (fp64, little-endian) and the encoded vector: what members compare."""
    return hashlib.sha256(struct.pack("<d", float(weight)) + bytes(payload)).hexdigest()[:16]


@dataclass
class _Contribution:
    weight: float
    positions: torch.Tensor  # int64 (K,), strictly increasing
    values: torch.Tensor  # fp32 (K,)
    digest: str


@dataclass
class _GatherSession:
    group: Group
    numel: int
    deadline: float
    contributions: dict[str, _Contribution] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    collected: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once our view is final: every member's vector in or refused, or the deadline passed."""
    bytes_sent: int = 0
    bytes_received: int = 0
    answered: set = field(default_factory=set)
    """Members our view was written to."""
    answer_written: asyncio.Event = field(default_factory=asyncio.Event)
    gone: set = field(default_factory=set)
    """Members our call could not reach: not waited for (neither excluded nor banned)."""

    def complete(self) -> bool:
        return all(m in self.contributions or m in self.excluded or m in self.gone for m in self.group.members)

    def have(self) -> dict[str, str]:
        return {m: c.digest for m, c in self.contributions.items()}


class SparseAllGather(Service):
    """All-gathers sparse (top-k) pseudo-gradients in a group and returns their weighted mean (see the module doc).

    Drop-in for :class:`protocols.allreduce.ButterflyAllReduce` (same constructor, :meth:`start`, :meth:`run`,
    :meth:`announce`, :attr:`codec`); selected by ``[averaging.allreduce] exchange = "gather"``, which needs a
    sparse codec. ``config.sender_timeout_s`` bounds the collection, ``config.reducer_timeout_s`` the whole run.
    """

    def __init__(self, transport: Transport, prefix: str, config: AllReduceConfig, bans: Optional[BanList] = None):
        self.transport = transport
        self.prefix = self.name = prefix
        self.config = config
        self.request_timeout_s = config.sender_timeout_s
        self.bans = bans if bans is not None else BanList()
        self.codec = config.make_codec()
        if not self.codec.sparse:
            raise ValueError(f"the sparse all-gather needs a sparse codec, got {config.compression!r}")
        self.rates: Optional[dict[str, float]] = None
        self._sessions: dict[str, _GatherSession] = {}
        self._session_ready: dict[str, asyncio.Event] = {}

    @property
    def handler_name(self) -> str:
        return self.handler_name_of("gather")

    def announce(self) -> dict:
        """Group-info entries for the matchmaking: none (there is no partition to balance)."""
        return {}

    async def run(self, group: Group, tensor: torch.Tensor, weight: float) -> AllReduceResult:
        """Gather ``tensor`` ((P,) fp32, encoded top-k) from every member, weighted by ``weight`` (samples), and
        return the weighted mean of the agreed contributions: ``averaged`` (P,) fp32, bit-identical on every member
        that heard every answer; ``sent`` (P,) fp32 is our own vector as decoded if it counted, else zeros. A group of
        one returns ``tensor`` itself, whole, as both (:meth:`AllReduceResult.alone`).

        Raises :class:`AllReduceFailed` if a member refused our vector; ValueError on bad local input.
        """
        me = self.transport.streams.peer_id
        tensor, weight = prepare_local_input(group, me, tensor, weight)
        if len(group.members) == 1:
            return AllReduceResult.alone(group, tensor, sparse=True)
        loop = asyncio.get_running_loop()
        start = loop.time()
        cpu_start = time.process_time()
        numel = tensor.numel()
        payload = self.codec.encode(tensor)
        positions, values = self.codec.decode_sparse(payload, numel)
        session = _GatherSession(group, numel, start + self.config.sender_timeout_s)
        session.contributions[me] = _Contribution(weight, positions, values, vector_digest(weight, payload))
        for member in group.members:
            if member != me and self.bans.is_banned(member):
                session.excluded[member] = f"banned: {self.bans.reason(member)}"
        self._sessions[group.group_id] = session
        self._session_ready.setdefault(group.group_id, asyncio.Event()).set()
        collector = asyncio.ensure_future(self._collect(session))
        header = {"group_id": group.group_id, "numel": numel, "weight": weight, "codec": self.codec.name}
        others = [m for m in group.members if m != me]
        try:
            answers = await asyncio.gather(*[self._send(peer, header, payload, start) for peer in others])
            await collector
            heard = {peer: have for peer, have in zip(others, answers) if have is not None}
            views = list(heard.values())
            counted = [m for m in group.members if m in session.contributions
                       and all(view.get(m) == session.contributions[m].digest for view in views)]
            unheard = await self._unheard(session, heard, start)
            if unheard:  # they did not hear our view: what every view lists, they may count
                theirs = [m for m in group.members if all(m in v and v[m] == views[0][m] for v in views)]
                missed = [m for m in theirs if m not in counted]
                if missed:
                    raise AllReduceFailed(f"{unheard} did not hear our view and may count vectors we do not: "
                                          f"{missed}")
            averaged = self._mean(numel, [session.contributions[m] for m in counted])
            sent = torch.zeros(numel, dtype=torch.float32)
            if me in counted:
                sent[positions] = values
            left_out = sorted(set(session.contributions) - set(counted))
            if left_out:
                logger.info("gather of group %s: left out %s (not every member accepted them)", group.group_id,
                            left_out)
            logger.info("gather of group %s (%s) done: %d of %d members counted", group.group_id, group.key,
                        len(counted), len(group.members),
                        extra={"event": "allreduce", "group_id": group.group_id, "key": group.key,
                               "group_size": len(group.members), "cpu_s": time.process_time() - cpu_start})
            return AllReduceResult(averaged, len(group.members), session.bytes_sent, session.bytes_received,
                                   loop.time() - start, len(counted), dict(session.excluded), sent)
        finally:
            collector.cancel()
            session.collected.set()  # answer the members still waiting with the view we have
            loop.call_later(self.config.reducer_timeout_s, self._forget, group.group_id)

    async def _unheard(self, session: _GatherSession, heard: dict, start: float, grace_s: float = 2.0) -> list[str]:
        """Members whose view we heard but that did not get ours (waiting briefly for our answers to be written)."""
        loop = asyncio.get_running_loop()
        deadline = min(loop.time() + grace_s, start + self.config.reducer_timeout_s)
        waiting = set(heard) - set(session.excluded)  # a member whose vector we refused gets no answer
        while not waiting <= session.answered and loop.time() < deadline:
            session.answer_written.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(session.answer_written.wait(), deadline - loop.time())
        return sorted(set(heard) - session.answered)

    @staticmethod
    def _mean(numel: int, contributions: list[_Contribution]) -> torch.Tensor:
        """sum_j w_j x_j / sum_j w_j over ``contributions`` in the given order, fp32; zeros if the weight is 0.
        The product and the sum are separate rounded operations so that no platform fuses them."""
        total = 0.0
        acc = torch.zeros(numel, dtype=torch.float32)
        for c in contributions:
            acc[c.positions] += c.values * torch.tensor(c.weight, dtype=torch.float32)
            total += c.weight
        if total <= 0:
            return torch.zeros(numel, dtype=torch.float32)
        return acc / torch.tensor(total, dtype=torch.float32)

    async def _collect(self, session: _GatherSession) -> None:
        loop = asyncio.get_running_loop()
        while not session.complete():
            remaining = session.deadline - loop.time()
            if remaining <= 0:
                missing = [m for m in session.group.members if m not in session.contributions
                           and m not in session.excluded]
                logger.info("gather of group %s goes on without %d late member(s): %s", session.group.group_id,
                            len(missing), sorted(missing))
                break
            session.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(session.changed.wait(), remaining)
        session.collected.set()

    async def _send(self, peer: str, header: dict, payload: bytes, start: float) -> Optional[dict[str, str]]:
        """Send our vector to ``peer``; its view ``{member: digest}``, or None if it did not answer (gone, late,
        or an answer we refuse: then it is also banned). Raises AllReduceFailed if it refused our vector."""
        loop = asyncio.get_running_loop()
        session = self._sessions[header["group_id"]]
        timeout = start + self.config.reducer_timeout_s - loop.time()
        try:
            reply = await call(self.transport.streams, peer, self.prefix, "gather", header, payload,
                               timeout_s=max(timeout, 0.0), max_reply_bytes=0)
        except Refused as e:
            if e.code == "unavailable":  # it never started this gather (late or gone): it constrains nobody
                logger.info("member %s is not in the gather: %s", peer, e.reason)
                return None
            raise AllReduceFailed(f"member {peer} refused our vector: {e.reason}") from e
        except (RpcTimeout, RpcError) as e:
            if isinstance(e, ProtocolViolation):
                self.bans.ban(peer, f"sent an invalid gather answer: {e}")
            elif isinstance(e, Unreachable):
                session.gone.add(peer)
                session.changed.set()
            logger.info("no gather answer from %s: %r", peer, e)
            return None
        session.bytes_sent += reply.bytes_sent
        session.bytes_received += reply.nbytes
        have = reply.header.get("have")
        if (not isinstance(have, dict) or len(have) > len(session.group.members)
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in have.items())):
            self.bans.ban(peer, "sent a malformed gather answer")
            logger.warning("malformed gather answer from %s: %r", peer, str(have)[:200])
            return None
        return have

    def _forget(self, group_id: str) -> None:
        self._sessions.pop(group_id, None)
        self._session_ready.pop(group_id, None)

    def _exclude(self, session: _GatherSession, peer: str, reason: str, ban: bool = True) -> None:
        session.excluded[peer] = reason
        if not session.collected.is_set():  # a final view was already answered to others: it stays as it was
            session.contributions.pop(peer, None)
        if ban:
            self.bans.ban(peer, reason)
        session.changed.set()
        logger.warning("excluded %s from group %s: %s", peer, session.group.group_id, reason,
                       extra={"event": "exclude", "peer": peer, "reason": reason})

    def on_bad_request(self, peer: str, method: str, error: RpcError) -> None:
        """Garbage (or a stall) before the group is known: ban the sender, exclude it from our open sessions."""
        logger.warning("dropped a gather request from %s: %r", peer, error)
        self.bans.ban(peer, f"malformed gather request: {error}")
        for session in self._sessions.values():
            if peer in session.group.members and peer not in session.contributions:
                session.excluded.setdefault(peer, f"malformed gather request: {error}")
                session.changed.set()

    async def rpc_gather(self, request: Request) -> None:
        """Accept one member's vector (validated before and after reading it); answer our view once collected."""
        peer, header = request.peer, request.header
        group_id = require(header, "group_id", str)  # a ProtocolViolation goes to on_bad_request
        try:
            ready = self._session_ready.setdefault(group_id, asyncio.Event())
            await asyncio.wait_for(ready.wait(), self.config.sender_timeout_s)
            session = self._sessions[group_id]
        except (asyncio.TimeoutError, KeyError) as e:
            if not self._sessions.get(group_id):
                self._session_ready.pop(group_id, None)
            raise Refused(f"unknown group: {e!r}", "unavailable") from None
        session.bytes_received += request.head_bytes
        reason = self._check_header(session, peer, header, request.size)
        if reason is None and self.bans.is_banned(peer):
            reason = f"banned: {self.bans.reason(peer)}"
        if reason is not None:
            self._exclude(session, peer, reason)
            raise Refused(reason)
        loop = asyncio.get_running_loop()
        numel, weight = header["numel"], float(header["weight"])
        # a member that starts after our collection ended is late, not stalled: it still gets our (final) view
        read_until = max(session.deadline, loop.time()) + self.config.sender_timeout_s
        try:
            payload = await request.payload(request.size, read_until - loop.time())
            positions, values = self.codec.decode_sparse(payload, numel)
        except RpcTimeout:
            reason = f"stalled: vector not delivered within sender_timeout_s={self.config.sender_timeout_s}"
        except Unreachable as e:  # a broken stream is not a lie (a crash, a dropped link, the path): no ban
            reason = f"connection broken: {e}"
            self._exclude(session, peer, reason, ban=False)
            raise Refused(reason) from None
        except (ValueError, RpcError) as e:
            reason = f"invalid vector: {type(e).__name__}: {e}"
        if reason is not None:
            self._exclude(session, peer, reason)
            raise Refused(reason)
        session.bytes_received += request.size
        if session.collected.is_set():
            logger.info("gather of group %s: the vector of %s came after our view was final", group_id, peer)
        else:
            session.contributions[peer] = _Contribution(weight, positions, values, vector_digest(weight, payload))
            session.changed.set()
        try:
            await asyncio.wait_for(session.collected.wait(), self.config.reducer_timeout_s)
        except asyncio.TimeoutError:
            raise Refused("our view was not final within reducer_timeout_s", "timeout") from None
        # not ``session.bytes_sent += await ...``: that reads the counter before the await and writes it back after,
        # losing what our own calls added meanwhile (a peer reported 121 of its ~11,900 bytes sent)
        sent = await request.reply({"have": session.have()})
        session.bytes_sent += sent
        session.answered.add(peer)
        session.answer_written.set()

    def _check_header(self, session: _GatherSession, peer: str, header: dict, size: int) -> Optional[str]:
        """None if the request header is acceptable, else the reason to exclude the sender."""
        if peer not in session.group.members:
            return "not a member of the group"
        if peer in session.contributions or peer in session.excluded:
            return "sent its vector twice"
        if header.get("codec") != self.codec.name:
            return f"codec {header.get('codec')!r} differs from the run's {self.codec.name!r}"
        numel = header.get("numel")
        if not isinstance(numel, int) or isinstance(numel, bool) or numel != session.numel:
            return f"vector of {numel!r} elements, expected {session.numel}"
        problem = weight_problem(header.get("weight"))
        if problem:
            return problem
        expected = self.codec.encoded_size(numel)
        if size != expected:
            return f"payload of {size} bytes, expected {expected}"
        return None
