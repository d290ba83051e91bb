"""The reducer's side of the butterfly: serving the members' parts of this peer's part (the RPC method ``reduce``),
validating and accumulating them chunk by chunk, sealing each chunk's aggregate and answering it to every member."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Optional

from protocols.allreduce.aggregate import weight_problem
from protocols.allreduce.chunks import decode_chunk, encode_chunk
from protocols.allreduce.config import AllReduceConfig
from protocols.allreduce.session import _ReduceSession
from protocols.bans import BanList
from protocols.codecs import Codec, all_finite
from protocols.interfaces import StreamReader, StreamWriter
from protocols.rpc import Refused, Request, RpcError, RpcTimeout, Unreachable, until
from protocols.wire import ProtocolViolation, StreamCorrupted, require

logger = logging.getLogger("protocols.allreduce")

#: A sender still sending after ``sender_timeout_s`` is slow, not stalled, while each next chunk arrives within this
#: many times its average time per chunk so far...
SLOW_SENDER_PACES = 4.0
#: ...and at least this many seconds (its chunks sealed without it are read and dropped, nothing is banned).
SLOW_SENDER_GRACE_S = 1.0


class ReducerSide:
    """The reducer's side of :class:`protocols.allreduce.ButterflyAllReduce` (a mixin on :class:`protocols.rpc.Service`):
    the ``reduce`` method and the sealing of this peer's part."""

    config: AllReduceConfig
    bans: BanList
    result_codec: Codec
    _sessions: dict[str, _ReduceSession]
    _session_ready: dict[str, asyncio.Event]

    def stream_handler(self, method: str):
        return self._handle_part  # a seam: tests wrap the reducer's side of a member's stream

    async def _handle_part(self, peer: str, reader: StreamReader, writer: StreamWriter) -> None:
        await self.serve("reduce", peer, reader, writer)

    def _seal_next(self, session: _ReduceSession) -> None:
        """Encode the next chunk's aggregate and wake the answers waiting for it. Raises ValueError if it is not
        finite (an overflow)."""
        k = len(session.sealed)
        aggregate = session.reducer.chunk_aggregate(k)
        if not all_finite(aggregate):
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

    def _exclude(self, session: _ReduceSession, peer: str, reason: str, ban: bool = True) -> None:
        session.excluded[peer] = reason
        if ban:
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
        received = False
        try:
            reason = await self._receive(request, session, sizes, float(header["weight"]), late)
            received = True
        finally:
            if not received:  # a late part that broke off (Refused), or we were cancelled: nobody reads the answer
                answering.cancel()
        if reason is not None:
            answering.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # boundary: the answer is abandoned either way
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
        longer is stalled: excluded and banned. A stream that breaks (Unreachable: its connection was reset or
        lost, or the transport found its bytes altered on the path, :class:`protocols.wire.StreamCorrupted`)
        excludes the member from this round without a ban (Refused): a crash, a pause, a dropped home link and an
        attack on the path look alike, and none is the member's lie. A stream the member itself ends mid-part
        breaks the protocol (ProtocolViolation): excluded and banned."""
        peer, k = request.peer, 0
        loop = asyncio.get_running_loop()
        opened = loop.time()
        started = session.deadline - self.config.sender_timeout_s  # our run's start
        dropped = 0
        arrived: list[tuple[float, int]] = []  # parts.TimedStream: each chunk's seconds since our start, bytes

        def on_frame(index: int, payload) -> None:
            nonlocal k, dropped
            k = index
            arrived.append((loop.time() - started, sizes[index]))
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
            if isinstance(e, Unreachable):  # a broken stream is not a lie: excluded from this round, no ban
                altered = isinstance(e.__cause__, StreamCorrupted)
                reason = f"chunk {k} of {len(sizes)}: {'altered on the path' if altered else 'connection broken'}: {e}"
                self._exclude(session, peer, reason, ban=False)
                raise Refused(reason) from None
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
        session.downloads.append(arrived)
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
        finally:
            session.answer_written(request.peer)
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
