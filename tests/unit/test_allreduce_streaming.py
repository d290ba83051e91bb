"""The streaming butterfly all-reduce, in-process: parts in chunks, reducers answering chunk k as soon as every
sender's chunk k is in, per-chunk validation (garbage, a stall or a death in chunk k of n), bandwidth-proportional
parts, and the framed calls of the RPC layer underneath."""

import asyncio
import math

import pytest
import torch

from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceConfig, AllReduceFailed, ButterflyAllReduce, ChunkedPartReducer, MIN_SHARE
from protocols.matchmaking import MatchmakingConfig
from protocols.rpc import ProtocolViolation, Refused, RpcError, RpcTimeout, Service, call_framed
from tests.streams import StreamsWrapper, breaking_transport

pytestmark = pytest.mark.timeout(60)

CHUNK = 4096
CHUNKS = 4  # per part
MM = MatchmakingConfig(3.0, 0.5, 0.05)


def _cfg(**kw):
    return AllReduceConfig(**{"compression": "none", "sender_timeout_s": 5.0, "reducer_timeout_s": 10.0,
                              "chunk_numel": CHUNK, **kw})


def _vector(i: int, n: int) -> torch.Tensor:
    """Member i's vector: integers, so every mean below is exact in fp32 whatever the summation order."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(-50, 50, (n * CHUNKS * CHUNK,), generator=g).float()


async def _group(peers, key="r"):
    groups = await asyncio.gather(*[p.matchmaker.form_group(key, {}, expected_size=len(peers)) for p in peers])
    return groups[0], {p.matchmaker.peer_id: p for p in peers}


async def _run_all(group, by_id, xs) -> dict:
    """Every member's all-reduce of ``xs[member]`` (weight 1) at once: {member: result, or the exception}."""
    return dict(zip(group.members, await asyncio.gather(
        *[by_id[m].allreduce.run(group, xs[m], 1.0) for m in group.members], return_exceptions=True)))


@pytest.mark.parametrize("compression", ["none", "fp16", "int8"])
def test_chunked_parts_give_the_unchunked_result_bit_for_bit(compression, averaging_peers):
    async def main():
        results = {}
        for chunk in (CHUNK, CHUNKS * CHUNK):  # four chunks per part, then one
            hub = Hub()
            peers = await averaging_peers(hub, 3, "run", MM, _cfg(compression=compression, chunk_numel=chunk))
            group, by_id = await _group(peers)
            xs = {m: _vector(i, 3) for i, m in enumerate(group.members)}
            out = await asyncio.gather(*[by_id[m].allreduce.run(group, xs[m], 1.0) for m in group.members])
            assert all(torch.equal(r.averaged, out[0].averaged) for r in out)
            assert all(r.contributors == 3 and not r.excluded for r in out)
            results[chunk] = out[0].averaged
        assert torch.equal(results[CHUNK], results[CHUNKS * CHUNK])
        if compression == "none":
            assert torch.equal(results[CHUNK], sum(_vector(i, 3) for i in range(3)) / 3)

    asyncio.run(main())


class _RecordingAllReduce(ButterflyAllReduce):
    """Records when each chunk of its own part was sealed."""

    def _seal_next(self, session):
        self.sealed_at = getattr(self, "sealed_at", [])
        self.sealed_at.append(asyncio.get_running_loop().time())
        super()._seal_next(session)


class _SlowWriter:
    """A writer that, once ``after`` bytes went through, waits ``delay_s`` in its next drain (a slow link); with
    ``repeat``, again after every further ``after`` bytes (a slow link that keeps its pace). Counts each wait in
    ``marks``."""

    def __init__(self, inner, after: int, delay_s: float, marks: list, repeat: bool = False):
        self.inner, self.after, self.delay_s, self.marks, self.repeat = inner, after, delay_s, marks, repeat
        self.since_wait = 0
        self.delayed = False

    def write(self, data):
        self.inner.write(data)
        self.since_wait += len(data)

    async def drain(self):
        if self.since_wait >= self.after and (self.repeat or not self.delayed):
            self.delayed, self.since_wait = True, 0
            self.marks.append(asyncio.get_running_loop().time())
            await asyncio.sleep(self.delay_s)
        await self.inner.drain()

    def close(self):
        self.inner.close()


class _WrappedStreams(StreamsWrapper):
    def __init__(self, inner, make_writer):
        self.inner, self.make_writer = inner, make_writer

    async def open(self, peer_id, name):
        reader, writer = await self.inner.open(peer_id, name)
        return reader, (self.make_writer(writer) if name.endswith(".reduce") else writer)


class _Wrapped:
    def __init__(self, transport, make_writer):
        self.discovery = transport.discovery
        self.streams = _WrappedStreams(transport.streams, make_writer)


def test_a_reducer_answers_early_chunks_while_a_slow_sender_still_sends_later_ones(averaging_peers):
    delay_s = 0.6
    marks: list = []

    async def main():
        hub = Hub()
        slow = lambda i, t: _Wrapped(t, lambda w: _SlowWriter(w, 2 * CHUNK * 4, delay_s, marks)) if i == 2 else t
        peers = await averaging_peers(hub, 3, "run", MM, _cfg(), allreduce_class=_RecordingAllReduce, wrap=slow)
        group, by_id = await _group(peers)
        xs = {m: _vector(i, 3) for i, m in enumerate(group.members)}
        out = await asyncio.gather(*[by_id[m].allreduce.run(group, xs[m], 1.0) for m in group.members])
        assert all(torch.equal(r.averaged, sum(xs.values()) / 3) for r in out)
        slow_id = peers[2].matchmaker.peer_id
        for m in group.members:
            if m == slow_id:
                continue
            sealed = by_id[m].allreduce.sealed_at
            assert len(sealed) == CHUNKS
            # the slow sender's first two chunks were in before its pause: those aggregates left during it
            assert max(sealed[:2]) < min(marks) + delay_s / 2, (sealed, marks)
            assert sealed[-1] >= min(marks) + delay_s - 0.05

    asyncio.run(main())


class _ChunkPoisoner(ButterflyAllReduce):
    """Sends valid chunks to the other reducers except chunk ``bad_chunk`` of every part, which is all NaN."""

    bad_chunk = 2

    def _encode_part(self, part):
        if float(part[0]) == 1000.0 + self.bad_chunk:  # this member's values mark the chunk index
            return torch.full_like(part, float("nan")).numpy().tobytes()
        return super()._encode_part(part)


def _marked(n_members: int) -> torch.Tensor:
    chunk_index = (torch.arange(n_members * CHUNKS * CHUNK) % (CHUNKS * CHUNK)) // CHUNK
    return 1000.0 + chunk_index.float()


def test_garbage_in_chunk_k_of_n_excludes_and_bans_the_sender_from_chunk_k_on(averaging_peers):
    async def main():
        hub = Hub()
        cls = lambda i: _ChunkPoisoner if i == 3 else ButterflyAllReduce
        peers = await averaging_peers(hub, 4, "run", MM, _cfg(), ban_s=60.0, allreduce_class=cls)
        group, by_id = await _group(peers)
        bad = peers[3].matchmaker.peer_id
        honest = [m for m in group.members if m != bad]
        xs = {m: _vector(i, 4) for i, m in enumerate(group.members)}
        xs[bad] = _marked(4)
        out = await _run_all(group, by_id, xs)
        assert isinstance(out[bad], AllReduceFailed)  # refused mid-answer by every honest reducer
        reference = out[honest[0]].averaged
        part = CHUNKS * CHUNK
        with_bad = (sum(xs[m] for m in honest) + xs[bad]) / 4
        without = sum(xs[m] for m in honest) / 3
        for m in honest:
            assert torch.equal(out[m].averaged, reference)
            assert bad in out[m].excluded and "chunk 2 of 4" in out[m].excluded[bad]
            assert by_id[m].bans.is_banned(bad)
            i = group.members.index(m)
            own = slice(i * part, (i + 1) * part)
            cut = i * part + _ChunkPoisoner.bad_chunk * CHUNK
            # chunks before the garbage hold the sender's valid values, chunk k and later exclude it
            assert torch.equal(reference[own.start:cut], with_bad[own.start:cut])
            assert torch.equal(reference[cut:own.stop], without[cut:own.stop])

    asyncio.run(main())


class _CutWriter:
    """Passes ``budget`` bytes, then either stalls (drops everything, stays open) or kills its peer on the hub."""

    def __init__(self, inner, budget: int, mode: str, hub: Hub, me: str):
        self.inner, self.budget, self.mode, self.hub, self.me = inner, budget, mode, hub, me
        self.written = 0

    def write(self, data):
        data = bytes(data)
        room = max(0, self.budget - self.written)
        if room:
            self.inner.write(data[:room])
        self.written += len(data)
        if self.written > self.budget and self.mode == "die":
            self.hub.disconnect(self.me)
            raise ConnectionResetError("died mid-chunk")

    async def drain(self):
        await self.inner.drain()

    def close(self):
        if self.mode == "die" or self.written <= self.budget:
            self.inner.close()


@pytest.mark.parametrize("mode", ["stall", "die"])
def test_a_sender_stalling_or_dying_mid_chunk_does_not_hold_the_round(mode, averaging_peers):
    sender_timeout_s = 1.5

    async def main():
        hub = Hub()
        budget = int(2.5 * CHUNK * 4)  # two whole chunks and half of the third
        cut = lambda i, t: (_Wrapped(t, lambda w: _CutWriter(w, budget, mode, hub, "peer03")) if i == 3 else t)
        peers = await averaging_peers(hub, 4, "run", MM, _cfg(sender_timeout_s=sender_timeout_s, reducer_timeout_s=5.0),
                                      ban_s=60.0, wrap=cut)
        group, by_id = await _group(peers)
        bad = "peer03"
        honest = [m for m in group.members if m != bad]
        xs = {m: _vector(i, 4) for i, m in enumerate(group.members)}
        loop = asyncio.get_running_loop()
        started = loop.time()
        bad_run = asyncio.ensure_future(by_id[bad].allreduce.run(group, xs[bad], 1.0))
        out = await asyncio.gather(*[by_id[m].allreduce.run(group, xs[m], 1.0) for m in honest],
                                   return_exceptions=True)
        elapsed = loop.time() - started
        print(f"FIGURE streaming {mode} in chunk 3 of {CHUNKS}: honest all-reduce ended after {elapsed:.2f} s "
              f"(sender_timeout_s {sender_timeout_s}): {[type(r).__name__ for r in out]}")
        bad_run.cancel()
        with_bad = sum(xs.values()) / 4
        without = sum(xs[m] for m in honest) / 3
        part = CHUNKS * CHUNK
        cut_at = 2 * CHUNK
        for m in honest:
            session = next(iter(by_id[m].allreduce._sessions.values()))
            i = group.members.index(m)
            mine = torch.frombuffer(bytearray(b"".join(bytes(s) for s in session.sealed)), dtype=torch.float32)
            # the sender's first two (whole) chunks count, its third (cut) one and the fourth do not
            assert torch.equal(mine[:cut_at], with_bad[i * part:i * part + cut_at])
            assert torch.equal(mine[cut_at:], without[i * part + cut_at:(i + 1) * part])
            result = out[honest.index(m)]
            if mode == "die":
                assert isinstance(result, AllReduceFailed)  # the dead member's own part is missing: the round fails
                assert bad in session.excluded and by_id[m].bans.is_banned(bad)
            else:  # the stalled member still reduces its own part: the round completes at the sender timeout
                assert not isinstance(result, BaseException), result
                assert torch.equal(result.averaged, out[0].averaged)
        # not held: a dead sender fails the round before anyone's sender timeout, a stalled one ends it at the sender
        # timeout, well before the reducer timeout (5 s) that a held round would reach
        assert elapsed < (sender_timeout_s if mode == "die" else 5.0)
        if mode == "stall":  # the stalled stream times out (its own sender timeout) and gets its sender banned
            sessions = {m: next(iter(by_id[m].allreduce._sessions.values())) for m in honest}
            while not all(bad in s.excluded for s in sessions.values()):
                await asyncio.sleep(0.05)  # the test's timeout bounds this wait
            for m in honest:
                assert "stalled: chunk 2 of 4" in sessions[m].excluded[bad]
                assert by_id[m].bans.is_banned(bad)

    asyncio.run(main())


def test_a_member_whose_connection_breaks_mid_part_is_excluded_from_the_round_not_banned(averaging_peers):
    # every honest reducer loses its connection to peer03 in the middle of peer03's third chunk (a crash, a dropped
    # home link, or a record altered on the path that the other end found): peer03 is excluded from this round at
    # once, its first two chunks kept, and not banned (the next round may have it back); a stall is banned
    async def main():
        hub = Hub()
        victim, fired = "peer03", []
        budget = int(2.5 * CHUNK * 4)  # two whole chunks and half of the third, header and prefixes aside
        wrap = lambda i, t: breaking_transport(t, ".reduce", victim, budget, fired) if i != 3 else t
        peers = await averaging_peers(hub, 4, "run", MM, _cfg(sender_timeout_s=5.0, reducer_timeout_s=10.0),
                                      ban_s=60.0, wrap=wrap)
        group, by_id = await _group(peers)
        honest = [m for m in group.members if m != victim]
        xs = {m: _vector(i, 4) for i, m in enumerate(group.members)}
        loop = asyncio.get_running_loop()
        started = loop.time()
        out = await _run_all(group, by_id, xs)
        elapsed = loop.time() - started
        print(f"FIGURE connection lost in chunk 3 of {CHUNKS}: fired {len(fired)}x; round ended after {elapsed:.2f} s "
              f"(sender_timeout_s 5.0); banned by "
              f"{sum(by_id[m].bans.is_banned(victim) for m in group.members if m != victim)}/3")
        assert len(fired) == 3  # each honest reducer's stream from the victim broke once
        assert elapsed < 5.0  # not held until the sender timeout
        assert isinstance(out[victim], AllReduceFailed)  # its part was refused by every other reducer
        with_victim, without = sum(xs.values()) / 4, sum(xs[m] for m in honest) / 3
        part, cut_at = CHUNKS * CHUNK, 2 * CHUNK
        for m in honest:
            session = next(iter(by_id[m].allreduce._sessions.values()))
            assert not by_id[m].bans.is_banned(victim)
            assert "connection broken" in session.excluded[victim], session.excluded
            i = group.members.index(m)
            mine = torch.frombuffer(bytearray(b"".join(bytes(s) for s in session.sealed)), dtype=torch.float32)
            assert torch.equal(mine[:cut_at], with_victim[i * part:i * part + cut_at])
            assert torch.equal(mine[cut_at:], without[i * part + cut_at:(i + 1) * part])

    asyncio.run(main())


def test_a_member_dead_before_it_sent_anything_fails_the_round_at_once_not_at_the_sender_timeout(averaging_peers):
    # a member that dies after matchmaking and before it sent a byte: every call to it fails, and nobody may wait
    # sender_timeout_s for its own part (each survivor stops waiting once its call to it failed)
    sender_timeout_s = 5.0

    async def main():
        hub = Hub()
        peers = await averaging_peers(hub, 4, "run", MM, _cfg(sender_timeout_s=sender_timeout_s), ban_s=60.0)
        group, by_id = await _group(peers)
        dead = "peer03"
        hub.disconnect(dead)
        honest = [m for m in group.members if m != dead]
        loop = asyncio.get_running_loop()
        started = loop.time()
        out = await asyncio.gather(*[by_id[m].allreduce.run(group, _vector(i, 4), 1.0) for i, m in enumerate(honest)],
                                   return_exceptions=True)
        elapsed = loop.time() - started
        print(f"FIGURE a member dead before sending: the survivors' round failed after {elapsed:.2f} s "
              f"(sender_timeout_s {sender_timeout_s})")
        assert all(isinstance(r, AllReduceFailed) and dead in str(r) for r in out), out
        assert elapsed < 1.0
        for m in honest:
            session = next(iter(by_id[m].allreduce._sessions.values()))
            assert session.finished.is_set() and len(session.sealed) == CHUNKS
            assert session.gone == {dead} and dead not in session.excluded
            assert not by_id[m].bans.is_banned(dead)  # dead or failed locally: the next round may have it back

    asyncio.run(main())


def test_a_member_refused_by_one_reducer_still_takes_that_reducers_part_and_the_others_agree(averaging_peers):
    # peer00 banned peer02 earlier: peer02's call to peer00 is refused at once and peer02 stops waiting for
    # peer00's part; peer00's part, sent to peer02 only afterwards, must still be taken and answered (refusing it
    # as a second part failed peer00's round while peer01's completed: their theta_outer forked)
    async def main():
        hub = Hub()
        opener: list = []
        later = _late_opening(0, "peer02", 0.3, 0.0, opener)
        peers = await averaging_peers(hub, 3, "run", MM, _cfg(sender_timeout_s=2.0, reducer_timeout_s=4.0),
                                      ban_s=60.0, wrap=later)
        group, by_id = await _group(peers)
        by_id["peer00"].bans.ban("peer02", "an earlier offence")
        xs = {m: _vector(i, 3) for i, m in enumerate(group.members)}
        out = await _run_all(group, by_id, xs)
        assert opener[0].delayed == 1  # peer00's part reached peer02 after peer02's call had been refused
        assert isinstance(out["peer02"], AllReduceFailed) and "refused" in str(out["peer02"])
        for m in ("peer00", "peer01"):
            assert not isinstance(out[m], BaseException), (m, out[m])
        assert torch.equal(out["peer00"].averaged, out["peer01"].averaged)
        session = next(iter(by_id["peer02"].allreduce._sessions.values()))
        assert session.gone == {"peer00"} and not session.excluded
        assert not by_id["peer02"].bans.is_banned("peer00")
        part = CHUNKS * CHUNK  # peer02 sealed its part without waiting for peer00: peer00's chunks were only read
        expected = (xs["peer01"] + xs["peer02"]) / 2
        assert torch.equal(out["peer01"].averaged[2 * part:], expected[2 * part:])

    asyncio.run(main())


def test_a_chunk_aggregated_in_place_is_closed_and_stays_the_same():
    reducer = ChunkedPartReducer(8, [(0, 4), (4, 8)])
    reducer.add("a", 0, torch.tensor([1.0, 2.0, 3.0, 4.0]), 1.0)
    reducer.add("b", 0, torch.tensor([3.0, 2.0, 1.0, 0.0]), 3.0)
    first = reducer.chunk_aggregate(0)
    assert torch.equal(first, torch.tensor([2.5, 2.0, 1.5, 1.0]))  # (x_a + 3 x_b) / 4
    assert torch.equal(reducer.chunk_aggregate(0), first)  # divided once, not on every call
    with pytest.raises(ValueError, match="already aggregated"):
        reducer.add("c", 0, torch.ones(4), 1.0)
    assert torch.equal(reducer.chunk_aggregate(0), first) and reducer.delivered == {"a": 1, "b": 1}
    assert torch.equal(reducer.chunk_aggregate(1), torch.zeros(4))  # nobody delivered chunk 1


class _LateOpener(StreamsWrapper):
    """Streams that open the ``.reduce`` stream to ``reducer`` only after ``delay_s`` (a sender on a loaded host
    whose call starts late) and then pause ``pause_s`` after its first chunk (so the reducer has to wait for the
    rest); counts the delayed opens."""

    def __init__(self, inner, reducer: str, delay_s: float, pause_s: float):
        self.inner, self.reducer, self.delay_s, self.pause_s = inner, reducer, delay_s, pause_s
        self.delayed = 0
        self.pauses: list = []

    async def open(self, peer_id, name):
        if peer_id == self.reducer and name.endswith(".reduce"):
            self.delayed += 1
            await asyncio.sleep(self.delay_s)
            reader, writer = await self.inner.open(peer_id, name)
            return reader, _SlowWriter(writer, CHUNK * 4, self.pause_s, self.pauses)
        return await self.inner.open(peer_id, name)


def _late_opening(index: int, reducer: str, delay_s: float, pause_s: float, opener: list):
    """A ``wrap`` for ``averaging_peers``: peer ``index`` opens its ``.reduce`` stream to ``reducer`` late
    (:class:`_LateOpener`, appended to ``opener``); the others are unchanged."""

    def wrap(i, t):
        if i != index:
            return t
        wrapped = _Wrapped(t, lambda w: w)
        wrapped.streams = _LateOpener(t.streams, reducer, delay_s, pause_s)
        opener.append(wrapped.streams)
        return wrapped

    return wrap


def test_a_sender_starting_after_the_deadline_is_late_not_banned_and_every_member_agrees(averaging_peers):
    # the late call arrives after the reducer's deadline and its 1 s of read grace, then sends its part at a slow pace
    sender_timeout_s, delay_s, pause_s = 0.5, 1.6, 0.3

    async def main():
        hub = Hub()
        opener: list = []
        late = _late_opening(2, "peer00", delay_s, pause_s, opener)
        peers = await averaging_peers(hub, 3, "run", MM, _cfg(sender_timeout_s=sender_timeout_s,
                                                               reducer_timeout_s=3.0), ban_s=60.0, wrap=late)
        group, by_id = await _group(peers)
        reducer, sender = "peer00", "peer02"
        xs = {m: _vector(i, 3) for i, m in enumerate(group.members)}
        out = await _run_all(group, by_id, xs)
        assert opener[0].delayed == 1  # only the late sender's call to peer00 was held back...
        assert len(opener[0].pauses) == 1  # ...and paused mid-part
        for m, result in out.items():
            assert not isinstance(result, BaseException), (m, result)
            assert torch.equal(result.averaged, out[reducer].averaged)  # every member, the late one too
            assert not result.excluded
        part = CHUNKS * CHUNK
        i = group.members.index(reducer)
        own = slice(i * part, (i + 1) * part)
        on_time = [m for m in group.members if m != sender]
        expected = sum(xs.values()) / 3
        expected[own] = sum(xs[m][own] for m in on_time) / 2  # the late part is left out of peer00's part only
        assert torch.equal(out[reducer].averaged, expected)
        assert out[reducer].contributors == 2 and out[sender].contributors == 3
        for p in peers:
            assert not p.bans.is_banned(sender)
        session = by_id[reducer].allreduce._sessions[group.group_id]
        assert session.late == [sender] and sender not in session.excluded

    asyncio.run(main())


class _PacedTowards(StreamsWrapper):
    """Streams whose ``.reduce`` stream to ``reducer`` waits ``pace_s`` after every chunk (:class:`_SlowWriter`)."""

    def __init__(self, inner, reducer: str, pace_s: float, marks: list):
        self.inner, self.reducer, self.pace_s, self.marks = inner, reducer, pace_s, marks

    async def open(self, peer_id, name):
        reader, writer = await self.inner.open(peer_id, name)
        if peer_id == self.reducer and name.endswith(".reduce"):
            return reader, _SlowWriter(writer, CHUNK * 4, self.pace_s, self.marks, repeat=True)
        return reader, writer


def test_a_slow_sender_that_keeps_its_pace_past_the_deadline_is_left_out_not_banned(averaging_peers):
    # chunk 0 arrives at once, then one chunk every 0.6 s: the part is sealed at 0.5 s without chunks 1-3 of the slow
    # sender, whose last chunk comes at ~1.8 s, after the sender deadline's 1 s of read grace (1.5 s): slow, not
    # stalled (it kept its pace), so it is read to its end and nobody bans it
    sender_timeout_s, pace_s = 0.5, 0.6
    marks: list = []

    async def main():
        hub = Hub()

        def wrap(i, t):
            if i != 2:
                return t
            wrapped = _Wrapped(t, lambda w: w)
            wrapped.streams = _PacedTowards(t.streams, "peer00", pace_s, marks)
            return wrapped

        peers = await averaging_peers(hub, 3, "run", MM, _cfg(sender_timeout_s=sender_timeout_s,
                                                               reducer_timeout_s=6.0), ban_s=60.0, wrap=wrap)
        group, by_id = await _group(peers)
        reducer, slow = "peer00", "peer02"
        xs = {m: _vector(i, 3) for i, m in enumerate(group.members)}
        out = await _run_all(group, by_id, xs)
        assert len(marks) >= CHUNKS - 1 and marks[-1] - marks[0] >= (CHUNKS - 2) * pace_s  # it did keep that pace
        for m, result in out.items():
            assert not isinstance(result, BaseException), (m, result)
            assert torch.equal(result.averaged, out[reducer].averaged)
            assert not result.excluded
        part = CHUNKS * CHUNK
        i = group.members.index(reducer)
        expected = sum(xs.values()) / 3
        others = (xs["peer00"] + xs["peer01"]) / 2
        lo = i * part + CHUNK  # chunk 0 of peer00's part has all three, chunks 1-3 the two on time
        expected[lo:(i + 1) * part] = others[lo:(i + 1) * part]
        assert torch.equal(out[reducer].averaged, expected)
        session = by_id[reducer].allreduce._sessions[group.group_id]
        assert session.late == [slow] and slow not in session.excluded  # (after peer00 returned: not in its result)
        for p in peers:
            assert not p.bans.is_banned(slow)

    asyncio.run(main())


def test_bandwidth_proportional_parts_from_announced_rates(averaging_peers):
    async def main():
        hub = Hub()
        peers = await averaging_peers(hub, 4, "run", MM, _cfg())
        rates = {"peer00": 100e6, "peer01": 100e6, "peer02": 20e6, "peer03": 20e6}
        for p in peers:
            p.allreduce.rates = {"up": rates[p.matchmaker.peer_id], "down": 10 * rates[p.matchmaker.peer_id]}
        groups = await asyncio.gather(*[p.matchmaker.form_group("r", p.allreduce.announce(), expected_size=4)
                                        for p in peers])
        group = groups[0]
        by_id = {p.matchmaker.peer_id: p for p in peers}
        xs = {m: _vector(i, 4) for i, m in enumerate(group.members)}
        out = await asyncio.gather(*[by_id[m].allreduce.run(group, xs[m], 1.0) for m in group.members])
        numel = xs[group.members[0]].numel()
        sizes = {m: s for m, s in zip(group.members, out[0].part_sizes)}
        assert sizes["peer02"] == sizes["peer03"] == 0  # the slow pair reduces nothing
        assert sizes["peer00"] + sizes["peer01"] == numel
        assert all(r.part_sizes == out[0].part_sizes for r in out)
        assert all(torch.equal(r.averaged, sum(xs.values()) / 4) for r in out)
        for p in peers:  # every run refreshes the measured rates
            assert p.allreduce.rates["up"] > 0 and math.isfinite(p.allreduce.rates["down"])

    asyncio.run(main())


class _Echo(Service):
    """Answers frame k of a framed request with its bytes reversed, as soon as frame k arrived."""

    name = "echo"

    async def rpc_frames(self, request):
        sizes = request.header["sizes"]
        k = 0
        async for payload in request.payload_frames(sizes):
            if request.header.get("refuse_at") == k:
                raise Refused("no more")
            await request.reply_frame(k, sizes, bytes(payload)[::-1])
            k += 1


class _PacedClient:
    """The client's streams, each drain waiting ``delay_s`` first (a slow link)."""

    peer_id = "client"

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    async def open(self, peer, name):
        reader, writer = await self.inner.open(peer, name)
        drain = writer.drain

        async def slow_drain():
            await asyncio.sleep(self.delay_s)
            await drain()

        writer.drain = slow_drain
        return reader, writer


def test_call_framed_pipelines_both_directions_and_checks_the_framing():
    async def main():
        hub = Hub()
        await _Echo().start(hub.transport("server"))
        inner = hub.transport("client").streams

        client = _PacedClient(inner, 0.02)  # slow enough that the answer to frame 0 comes back before frame 2 leaves
        events = []
        sizes = [5, 5, 3]

        def frames():
            for k, size in enumerate(sizes):
                events.append(("sent", k))
                yield bytes([k]) * size

        got = {}

        def on_frame(k, payload):
            events.append(("got", k))
            got[k] = bytes(payload)

        _, sent, received = await call_framed(client, "server", "echo", "frames", {"sizes": sizes}, frames(), sizes,
                                              sizes, on_frame, timeout_s=5.0)
        assert got == {k: bytes([k]) * s for k, s in enumerate(sizes)}
        assert events.index(("got", 0)) < events.index(("sent", 2))  # the answer overlaps the request
        assert sent >= sum(sizes) and received >= sum(sizes)
        with pytest.raises(ProtocolViolation):  # the reply is framed otherwise than agreed
            await call_framed(client, "server", "echo", "frames", {"sizes": sizes}, iter([b"a" * 5, b"b" * 5,
                              b"c" * 3]), sizes, [5, 4, 4], lambda k, p: None, timeout_s=5.0)
        with pytest.raises(Refused):  # a refusal in place of frame 1
            await call_framed(client, "server", "echo", "frames", {"sizes": sizes, "refuse_at": 1},
                              iter([b"a" * 5, b"b" * 5, b"c" * 3]), sizes, sizes, lambda k, p: None, timeout_s=5.0)
        with pytest.raises(ValueError):  # our own frame of the wrong size never reaches the wire as such
            await call_framed(client, "server", "echo", "frames", {"sizes": sizes}, iter([b"a" * 4]), sizes, sizes,
                              lambda k, p: None, timeout_s=5.0)

    asyncio.run(main())


class _DeadlineReader(Service):
    """Reads a framed request under a 0.15 s deadline, moved to 0.15 s after every frame if ``extend``."""

    name = "reader"

    def __init__(self, extend: bool):
        super().__init__()
        self.extend, self.outcome = extend, []

    async def rpc_frames(self, request):
        sizes = request.header["sizes"]
        loop = asyncio.get_running_loop()
        got: list = []
        moved = (lambda k: loop.time() + 0.15) if self.extend else None
        try:
            await request.read_frames(sizes, lambda k, payload: got.append(k), loop.time() + 0.15, moved)
        except RpcTimeout:
            self.outcome.append(("timeout", got))
            raise
        self.outcome.append(("read", got))
        for k, size in enumerate(sizes):
            await request.reply_frame(k, sizes, b"x" * size)


@pytest.mark.parametrize("timer", ["timeout_at", "per frame"])
@pytest.mark.parametrize("extend", [True, False])
def test_read_frames_deadline_moves_with_each_frame_when_extended(extend, timer, monkeypatch):
    # 4 frames 0.1 s apart take ~0.3 s: past a fixed 0.15 s deadline, within one moved to 0.15 s after every frame;
    # "per frame" is the path of Pythons without asyncio.timeout_at (each frame bounded by the current deadline)
    if timer == "per frame":
        monkeypatch.delattr(asyncio, "timeout_at", raising=False)

    async def main():
        hub = Hub()
        reader = _DeadlineReader(extend)
        await reader.start(hub.transport("server"))
        inner = hub.transport("client").streams

        sizes = [5, 5, 5, 5]
        call = call_framed(_PacedClient(inner, 0.1), "server", "reader", "frames", {"sizes": sizes}, iter([b"a" * 5] * 4), sizes,
                           sizes, lambda k, p: None, timeout_s=5.0)
        if extend:
            await call
            assert reader.outcome == [("read", [0, 1, 2, 3])]
        else:
            with pytest.raises(RpcError):
                await call
            assert reader.outcome[0][0] == "timeout" and len(reader.outcome[0][1]) < 4

    asyncio.run(main())


def test_rates_within_the_spread_give_equal_parts_and_missing_rates_too():
    from protocols.matchmaking import Group

    ar = ButterflyAllReduce(Hub().transport("a"), "run", _cfg())
    members = ("a", "b", "c")
    near = Group("g", "k", "a", members, {m: {"rates": {"up": r, "down": r}} for m, r in zip(members, (10, 12, 14))})
    assert ar.part_sizes(near, 10) == [4, 3, 3]
    partial = Group("g", "k", "a", members, {"a": {"rates": {"up": 100, "down": 100}}, "b": {}, "c": {}})
    assert ar.part_sizes(partial, 10) == [4, 3, 3]
    far = Group("g", "k", "a", members, {m: {"rates": {"up": r, "down": r}} for m, r in zip(members, (100, 100, 0))})
    assert ar.part_sizes(far, 10) == [5, 5, 0]
    equal = ButterflyAllReduce(Hub().transport("a"), "run", _cfg(partition="equal"))
    assert equal.part_sizes(far, 10) == [4, 3, 3]


def test_measured_rates_are_the_median_of_recent_long_runs_and_announced_only_after_enough_runs():
    from protocols.allreduce import RATE_HISTORY, RATE_MIN_BYTES, RATE_MIN_RUNS

    ar = ButterflyAllReduce(Hub().transport("a"), "run", _cfg())
    big = RATE_MIN_BYTES
    ar._measure([[(1.0, big)]], [[(1.0, big // 10)]])  # too few bytes down: latency, not the link
    ar._measure([], [])  # nothing measured
    assert ar.rates is None and ar.announce() == {}
    for up in (100.0, 300.0, 200.0)[:RATE_MIN_RUNS - 1]:
        ar._measure([[(big / up, big)]], [[(big / (up / 2), big)]])
        assert ar.rates is None and ar.announce() == {}  # not enough runs yet: equal parts
    ar._measure([[(big / 200.0, big)]], [[(big / 100.0, big)]])
    assert ar.rates == {"up": pytest.approx(200.0), "down": pytest.approx(100.0)}
    assert ar.announce() == {"rates": ar.rates}
    ar._measure([[(big / 200.0, big)]], [[(big / 100.0, big)]])
    ar._measure([[(big / 10_000.0, big)]], [[(big / 1.0, big)]])  # one outlier run (host load) moves nothing
    assert ar.rates == {"up": pytest.approx(200.0), "down": pytest.approx(100.0)}
    for _ in range(RATE_HISTORY):  # a link that really changed takes over once most recent runs say so
        ar._measure([[(big / 50.0, big)]], [[(big / 50.0, big)]])
    assert ar.rates == {"up": pytest.approx(50.0), "down": pytest.approx(50.0)}


def test_noisy_rates_within_the_floor_spread_leave_every_member_a_part():
    from protocols.matchmaking import Group
    from protocols.partition import FLOOR_SPREAD

    ar = ButterflyAllReduce(Hub().transport("a"), "run", _cfg())
    members = ("a", "b", "c", "d")
    # equal links measured 3x apart on a loaded host: without the floor "d" would reduce nothing
    noisy = Group("g", "k", "a", members, {m: {"rates": {"up": r, "down": r}}
                                           for m, r in zip(members, (300, 300, 250, 100))})
    assert 3 < FLOOR_SPREAD
    sizes = ar.part_sizes(noisy, 4096)
    assert sum(sizes) == 4096 and min(sizes) >= 4096 * MIN_SHARE // 4 - 1  # MIN_SHARE of an equal part (rounding)
    assert min(sizes) > 0
    assert sizes[0] > sizes[3]  # still proportional above the floor


def test_a_short_stream_does_not_inflate_the_measured_rate():
    """A stream of a few hundred KB (a floor part of a small vector) is "done" once it sits in the buffers: its
    bytes over its duration measure the buffers, not the link. Streams under RATE_MIN_STREAM_BYTES do not count."""
    from protocols.allreduce import RATE_MIN_BYTES, RATE_MIN_RUNS, RATE_MIN_STREAM_BYTES

    ar = ButterflyAllReduce(Hub().transport("a"), "run", _cfg())
    big, small = RATE_MIN_BYTES, RATE_MIN_STREAM_BYTES - 1
    for _ in range(RATE_MIN_RUNS):
        # two long streams at 100 B/s each (the link: 200 B/s), one short stream handed over at once
        ar._measure([[(big / 100.0, big)], [(big / 100.0, big)], [(0.001, small)]],
                    [[(big / 150.0, big)], [(0.001, small)]])
    assert ar.rates == {"up": pytest.approx(200.0), "down": pytest.approx(150.0)}


def _steady(rate: float, nbytes: int, chunks: int = 16, start_s: float = 0.0) -> list[tuple[float, int]]:
    """A stream of ``nbytes`` in ``chunks`` equal chunks moving at ``rate`` bytes/s from ``start_s`` on."""
    size = nbytes // chunks
    return [(start_s + (k + 1) * size / rate, size) for k in range(chunks)]


def test_streams_that_end_at_different_times_read_the_link_not_more():
    """A 2.5 MB/s uplink shared unevenly by two 12 MB streams: one at 1.6 MB/s ends at 7.5 s, the other gets the
    rest (0.9 MB/s) and then the whole link. Each stream's own average pace summed read 2.9 MB/s; the link is 2.5."""
    from protocols.allreduce.parts import link_rate

    mb = 1_000_000
    first = _steady(1.6 * mb, 12 * mb)  # ends at 7.5 s
    second = _steady(0.9 * mb, int(0.9 * 7.5 * mb), 8)
    second += _steady(2.5 * mb, 12 * mb - sum(b for _, b in second), 8, start_s=second[-1][0])
    each_own_pace = sum(sum(b for _, b in s) / s[-1][0] for s in (first, second))  # the estimate before
    assert each_own_pace > 2.8 * mb
    rate, counted = link_rate([first, second])
    assert rate == pytest.approx(2.5 * mb, rel=0.03) and counted == sum(b for _, b in first + second)


def test_a_stream_slowed_by_the_other_end_does_not_pull_a_fast_link_down():
    """A fast uplink (12 MB/s) sends 10 MB to a fast peer in 1 s while 12 MB to a slow peer (its 2 MB/s download)
    take 6 s: the link reads as that first second says (11.5 MB/s), not as everything over the last end (3.7)."""
    from protocols.allreduce.parts import link_rate

    mb = 1_000_000
    fast = _steady(10 * mb, 10 * mb)  # 1 s
    slow = _steady(2 * mb, 12 * mb)  # 6 s
    rate, _ = link_rate([fast, slow])
    assert rate == pytest.approx(11.5 * mb, rel=0.01)
    assert link_rate([fast[:1], slow[:1]]) == (0.0, 0)  # streams under RATE_MIN_STREAM_BYTES: nothing counted
