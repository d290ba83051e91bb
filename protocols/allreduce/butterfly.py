"""The butterfly all-reduce as a service: the member's side of a run (send our slice of every part, receive every
part's aggregate) on top of the reducer's side (:mod:`protocols.allreduce.reducer`) and the part scheduling
(:mod:`protocols.allreduce.parts`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Callable, Optional, Sequence, Union

import torch

from protocols.allreduce.aggregate import ChunkedPartReducer, prepare_local_input, prepare_out
from protocols.allreduce.chunks import decode_chunk_into, encode_chunk
from protocols.allreduce.config import AllReduceConfig, AllReduceFailed, AllReduceResult
from protocols.allreduce.parts import PartPlanner, TimedStream, connection_shares
from protocols.allreduce.reducer import ReducerSide
from protocols.allreduce.session import _ReduceSession
from protocols.bans import BanList
from protocols.codecs import get_codec
from protocols.interfaces import Transport, UplinkLease
from protocols.matchmaking import Group
from protocols.partition import chunk_bounds
from protocols.rpc import Refused, RpcError, RpcTimeout, Service, call_framed

logger = logging.getLogger("protocols.allreduce")


class _InvalidMean(Exception):
    """A reducer answered with bytes that do not decode to finite values of the right size."""


class ButterflyAllReduce(PartPlanner, ReducerSide, Service):
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
        super().__init__()
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

    @property
    def handler_name(self) -> str:
        return self.handler_name_of("reduce")

    def _round_trip(self, part: torch.Tensor) -> torch.Tensor:
        """What ``part`` decodes to at its reducer (fp32, its length). Chunks are multiples of every codec's block,
        so the whole part round-trips to the same values as its chunks do, in one call."""
        if self.codec.name == "none":
            return part
        return self.codec.decode(encode_chunk(self.codec, part, checked=True), part.numel())

    async def run(self, group: Group, tensor: torch.Tensor, weight: float,
                  out: Optional[torch.Tensor] = None) -> AllReduceResult:
        """Average ``tensor`` (P,) fp32 with the group, weighted by ``weight`` (e.g. samples processed).

        Every member must call this with the same group and the same P. ``out``: the (P,) fp32 CPU buffer the
        average is written into (it may be ``tensor`` itself: 4P bytes of memory less; after a failure it holds
        some parts' averages and some of the input); None: a fresh one (see :func:`prepare_out`). Raises
        :class:`AllReduceFailed` if any part's mean could not be obtained within ``reducer_timeout_s``; ValueError
        on bad local input. A group of one returns ``tensor`` itself (:meth:`AllReduceResult.alone`), copied into
        ``out`` where that is another buffer.
        """
        me = self.transport.streams.peer_id
        tensor, weight = prepare_local_input(group, me, tensor, weight)
        out = prepare_out(out, tensor, self.codec.sparse)
        if len(group.members) == 1:
            if out is not None and out.data_ptr() != tensor.data_ptr():
                tensor = out.copy_(tensor)
            return AllReduceResult.alone(group, tensor, self.codec.sparse)
        loop = asyncio.get_running_loop()
        start = loop.time()
        cpu_start = time.process_time()
        sizes = self.part_sizes(group, tensor.numel())
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        my_index = group.members.index(me)

        bounds = chunk_bounds(sizes[my_index], self.config.chunk_numel)
        session = _ReduceSession(
            group, sizes[my_index], bounds, self.codec,
            ChunkedPartReducer(sizes[my_index], bounds, self.config.aggregation, self.config.clip_tau),
            start + self.config.sender_timeout_s,
        )
        for member in group.members:  # do not wait for parts we would refuse anyway
            if member != me and self.bans.is_banned(member):
                session.excluded[member] = f"banned: {self.bans.reason(member)}"
        own = tensor[offsets[my_index] : offsets[my_index] + sizes[my_index]]
        own_sent = self._round_trip(own)
        for k, (a, b) in enumerate(bounds):
            session.reducer.add(me, k, own_sent[a:b], weight, finite_checked=True)
        self._sessions[group.group_id] = session
        self._session_ready.setdefault(group.group_id, asyncio.Event()).set()
        sealer = asyncio.ensure_future(self._seal_chunks(session))
        averaged = torch.empty_like(tensor) if out is None else out
        # each of our streams as a sender (a parts.TimedStream: its chunks' times and bytes): our slices up, the
        # answers down
        uploaded: list[TimedStream] = []
        downloaded: list[TimedStream] = []
        uplink = self._pace_uplink(group, sizes, my_index)
        handed_over = _release_once_sent(group.members, my_index, sizes, uplink)
        session.answer_written = handed_over

        async def exchange(i: int, peer: str) -> tuple[torch.Tensor, int, int]:
            if not sizes[i]:  # it reduces nothing: no stream (a dial-only member is dialed by nobody)
                return averaged[offsets[i]:offsets[i]], 0, 0
            try:
                return await self._exchange(peer, group, tensor[offsets[i] : offsets[i] + sizes[i]], weight, start,
                                            averaged[offsets[i] : offsets[i] + sizes[i]], uploaded, downloaded,
                                            handed_over)
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
            self._measure(uploaded, downloaded + session.downloads)
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
            if uplink is not None:
                uplink.close()
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

    def _pace_uplink(self, group: Group, sizes: list[int], my_index: int) -> Optional[UplinkLease]:
        """For this run, pace our connection to each member at its share of our uplink
        (:func:`protocols.allreduce.parts.connection_shares`), where the transport can
        (:class:`protocols.interfaces.UplinkPacing`); returns the lease (released per member by
        :func:`_release_once_sent`, closed when the run ends), or None. ``sizes``: values each member reduces, in
        member order. Unpaced, the connections of the all-to-all take turns overfilling the queue at the sender's
        bottleneck and back off; paced at their shares, 4 peers at 100 Mbit/s moved 0.89-0.92 of the link, against
        0.76-0.79 (docs/benchmarks.md, ``scripts/bench_allreduce.py --impls peerd-mux peerd-mux-paced``)."""
        pace = getattr(self.transport.streams, "pace_uplink", None)
        if pace is None:
            return None
        shares = connection_shares(sizes, my_index)
        return pace({m: share for j, (m, share) in enumerate(zip(group.members, shares)) if j != my_index})

    @staticmethod
    def call_failed(who: str, error: RpcError) -> AllReduceFailed:
        """What a member's failed call to ``who`` (e.g. "reducer <PeerID>") means for its round: the failure, with
        the reason (the call timed out past ``reducer_timeout_s``, was refused, or broke)."""
        if isinstance(error, RpcTimeout):
            return AllReduceFailed(f"{who} did not finish within reducer_timeout_s")
        if isinstance(error, Refused):
            return AllReduceFailed(f"{who} refused: {error.reason}")
        return AllReduceFailed(f"{who} failed: {error!r}")

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

    async def _exchange(
        self, peer: str, group: Group, part: torch.Tensor, weight: float, start: float,
        out: torch.Tensor, uploaded: list[TimedStream], downloaded: list[TimedStream],
        handed_over: Optional[Callable[[str], None]] = None,
    ) -> tuple[torch.Tensor, int, int]:
        """Send our slice of ``peer``'s part, chunk by chunk, while its aggregate streams back into ``out`` (fp32,
        the part's length). Returns ``(out, bytes sent, bytes received)``; appends the stream up (a
        :data:`parts.TimedStream`: each chunk's seconds since ``start`` once handed to the transport, and its bytes)
        to ``uploaded`` once our last chunk was handed over, and the stream down to ``downloaded`` once the last
        chunk of the aggregate arrived. ``handed_over(peer)`` is called once our last chunk was handed over."""
        loop = asyncio.get_running_loop()
        timeout = start + self.config.reducer_timeout_s - loop.time()
        header = {"group_id": group.group_id, "numel": part.numel(), "weight": weight, "codec": self.codec.name}
        bounds = chunk_bounds(part.numel(), self.config.chunk_numel)

        sizes = [self.codec.encoded_size(b - a) for a, b in bounds]
        reply_sizes = [self.result_codec.encoded_size(b - a) for a, b in bounds]

        handed: list[tuple[float, int]] = []
        arrived: list[tuple[float, int]] = []

        def frames():
            for k, (a, b) in enumerate(bounds):
                yield self._encode_part(part[a:b])
                handed.append((loop.time() - start, sizes[k]))  # asked for the next one: chunk k was handed over
            uploaded.append(handed)
            if handed_over is not None:
                handed_over(peer)

        def on_frame(k: int, payload) -> None:
            arrived.append((loop.time() - start, reply_sizes[k]))
            a, b = bounds[k]
            try:
                decode_chunk_into(self.result_codec, payload, out[a:b])
            except ValueError as e:
                raise _InvalidMean(str(e)) from None

        try:
            _, sent, received = await call_framed(
                self.transport.streams, peer, self.prefix, "reduce", header, frames(), sizes, reply_sizes, on_frame,
                timeout_s=max(timeout, 0.0))
        except RpcError as e:
            raise self.call_failed(f"reducer {peer}", e) from e
        except _InvalidMean as e:  # wrong size or non-finite values: a faulty or hostile reducer
            self.bans.ban(peer, f"sent an invalid mean: {e}")
            raise AllReduceFailed(f"reducer {peer} failed: sent an invalid mean: {e}") from None
        downloaded.append(arrived)
        return out, sent, received

    def _encode_part(self, part: torch.Tensor) -> Union[bytes, memoryview]:
        """Encode one chunk of our slice of another member's part (a seam for fault-injection tests); run() checked
        the whole vector finite."""
        return encode_chunk(self.codec, part, checked=True)


def _release_once_sent(members: Sequence[str], me: int, sizes: Sequence[int],
                       uplink: Optional[UplinkLease]) -> Callable[[str], None]:
    """``handed_over(member)``, to be called once our slice of ``member``'s part was handed over and once our part's
    answer to it was (each where there is one: ``sizes`` are the values each member reduces, ``me`` our index);
    after both, the member's share of ``uplink`` goes to the members still being sent to
    (:meth:`protocols.interfaces.UplinkLease.release`). The same connection carries both: released after the slice
    alone, it sent the answers unpaced, overfilling the link's queue at the end of every run (8 peers at 100 Mbit/s:
    0.85 / 0.75 of the link, fp32 / fp16, against 0.89 / 0.87 held to the answers' end; docs/benchmarks.md,
    2026-11-28). Calls for strangers, or beyond the two, change nothing."""
    unsent = {m: (sizes[i] > 0) + (sizes[me] > 0) for i, m in enumerate(members) if i != me}

    def handed_over(member: str) -> None:
        if unsent.get(member, 0) > 0:
            unsent[member] -= 1
            if not unsent[member] and uplink is not None:
                uplink.release(member)

    return handed_over
