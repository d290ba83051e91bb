"""Hostile and stalled senders in the butterfly all-reduce (RELIABILITY rows A5, B2, B3), in-process.

Every variant is injected by a member that reduces its own part honestly but sends a crafted frame to each honest
reducer; the injector counts what it sent, and each honest reducer must exclude and ban it while the honest parts
stay the exact honest mean.
"""

import asyncio
import struct
import time
from collections import Counter

import msgpack
import pytest
import torch

from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceConfig, ButterflyAllReduce
from protocols.matchmaking import AdmissionRefused, MatchmakingConfig
from tests.streams import CountingReader

pytestmark = pytest.mark.timeout(60)

SENDER_TIMEOUT_S = 3.0


class HostileAllReduce(ButterflyAllReduce):
    """Reduces its own part honestly; sends ``mode``-crafted parts to everyone else and counts them."""

    mode = "nan"
    fired = 0

    async def _exchange(self, peer, group, part, weight, start, *_):
        reader, writer = await self.transport.streams.open(peer, self.handler_name)
        n = part.numel()
        header = {"group_id": group.group_id, "numel": n, "weight": 1.0, "codec": "none"}
        payload = part.numpy().tobytes()
        mode = self.mode
        if mode == "nan":
            payload = torch.full((n,), float("nan")).numpy().tobytes()
        elif mode == "inf":
            payload = torch.full((n,), float("inf")).numpy().tobytes()
        elif mode == "wrong_numel":
            header["numel"] = n + 1
            payload = torch.zeros(n + 1).numpy().tobytes()
        elif mode == "weight_huge":
            header["weight"] = 1e13
        elif mode == "weight_negative":
            header["weight"] = -1.0
        elif mode == "wrong_dtype_codec":
            header["codec"] = "fp64"
        header_bytes = msgpack.packb(header)
        if mode == "oversized":
            writer.write(struct.pack(">II", len(header_bytes), 2**31 - 1) + header_bytes)  # and never the body
        elif mode == "garbage_header":
            writer.write(struct.pack(">II", 16, 0) + b"\xc1" * 16)
        elif mode == "stall_header":  # half of the 8-byte prefix, then silent
            writer.write(struct.pack(">II", len(header_bytes), len(payload))[:4])
            await asyncio.sleep(SENDER_TIMEOUT_S + 3)
        elif mode in ("truncated", "stall"):
            writer.write(struct.pack(">II", len(header_bytes), len(payload)) + header_bytes + payload[: len(payload) // 2])
            if mode == "truncated":
                writer.close()
            else:
                await asyncio.sleep(SENDER_TIMEOUT_S + 3)  # hold the stream open, send nothing more
        else:
            writer.write(struct.pack(">II", len(header_bytes), len(payload)) + header_bytes + payload)
        HostileAllReduce.fired += 1
        writer.close()
        return torch.zeros(n), 0, 0


class CountingAllReduce(ButterflyAllReduce):
    """Honest; records how many bytes of the hostile member's stream its reducer read (RELIABILITY B3 figure)."""

    bytes_read: Counter = Counter()

    async def _handle_part(self, peer, reader, writer):
        if peer != "peer3":
            return await super()._handle_part(peer, reader, writer)
        counted = CountingReader(reader)
        try:
            return await super()._handle_part(peer, counted, writer)
        finally:
            CountingAllReduce.bytes_read[self.transport.streams.peer_id] += counted.n


async def _swarm(averaging_peers, hub, mode):
    cfg = AllReduceConfig("none", SENDER_TIMEOUT_S, 2 * SENDER_TIMEOUT_S + 2)
    peers = await averaging_peers(hub, [f"peer{i}" for i in range(4)], "h", MatchmakingConfig(3.0, 0.5, 0.05), cfg,
                                  ban_s=60.0, allreduce_class=lambda i: HostileAllReduce if i == 3 else CountingAllReduce)
    HostileAllReduce.mode = mode
    HostileAllReduce.fired = 0
    CountingAllReduce.bytes_read = Counter()
    return peers


MODES = ["nan", "inf", "wrong_numel", "weight_huge", "weight_negative", "wrong_dtype_codec", "oversized",
         "garbage_header", "truncated"]


@pytest.mark.parametrize("mode", MODES)
def test_invalid_parts_are_excluded_and_the_sender_banned(mode, averaging_peers):
    async def main():
        hub = Hub()
        peers = await _swarm(averaging_peers, hub, mode)
        groups = await asyncio.gather(*[mm.form_group("r", {}, expected_size=4) for mm, _ in peers])
        group = groups[0]
        xs = {m: torch.full((40,), float(i + 1)) for i, m in enumerate(group.members)}
        by_id = {p.matchmaker.peer_id: (p.allreduce, p.bans) for p in peers}
        results = await asyncio.gather(*[by_id[m][0].run(group, xs[m], 1.0) for m in group.members])
        hostile = "peer3"
        honest = [m for m in group.members if m != hostile]
        assert HostileAllReduce.fired == 3
        honest_mean = sum(xs[m] for m in honest) / 3
        reference = results[group.members.index(honest[0])].averaged
        error = max(float((reference[i * 10:(i + 1) * 10] - honest_mean[i * 10:(i + 1) * 10]).abs().max())
                    for i, m in enumerate(group.members) if m != hostile)
        banned = sum(by_id[m][1].is_banned(hostile) for m in honest)
        read = sorted(CountingAllReduce.bytes_read.values())
        print(f"FIGURE {'B3' if mode in ('oversized', 'garbage_header', 'truncated') else 'B2'} {mode}: fired "
              f"{HostileAllReduce.fired}x; banned by {banned}/3; max abs error of honest parts vs honest mean "
              f"{error:.3g}; bytes each honest reducer read from the hostile stream {read}")
        for m, res in zip(group.members, results):
            if m == hostile:
                continue
            assert torch.equal(res.averaged, reference)  # honest members agree bit for bit
            assert hostile in res.excluded
            assert by_id[m][1].is_banned(hostile)
        # every part reduced by an honest member is exactly the honest mean
        for idx, m in enumerate(group.members):
            if m != hostile:
                assert torch.equal(reference[idx * 10:(idx + 1) * 10], honest_mean[idx * 10:(idx + 1) * 10])

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["stall", "stall_header"])
def test_stalled_sender_does_not_hold_the_round_and_is_banned(mode, averaging_peers):
    async def main():
        hub = Hub()
        peers = await _swarm(averaging_peers, hub, mode)
        groups = await asyncio.gather(*[mm.form_group("r", {}, expected_size=4) for mm, _ in peers])
        group = groups[0]
        by_id = {p.matchmaker.peer_id: (p.allreduce, p.bans) for p in peers}
        honest = [m for m in group.members if m != "peer3"]
        started = time.monotonic()
        hostile_run = asyncio.ensure_future(by_id["peer3"][0].run(group, torch.zeros(40), 1.0))
        results = await asyncio.gather(*[by_id[m][0].run(group, torch.ones(40), 1.0) for m in honest])
        elapsed = time.monotonic() - started
        stalled = "header + half of its part" if mode == "stall" else "half of its frame prefix"
        print(f"FIGURE A5 in-process ({mode}): honest all-reduce {elapsed:.2f} s vs sender_timeout_s "
              f"{SENDER_TIMEOUT_S} s (stalled sender: {stalled}, then silent {SENDER_TIMEOUT_S + 3:.0f} s)")
        assert elapsed <= SENDER_TIMEOUT_S + 0.5, elapsed  # RELIABILITY A5
        # the parts honest members reduce are exactly the honest mean (the stalled member reduces its own part)
        for r in results:
            for idx, m in enumerate(group.members):
                if m != "peer3":
                    assert torch.equal(r.averaged[idx * 10:(idx + 1) * 10], torch.ones(10))
        await asyncio.sleep(1.5)  # the stalled streams time out and get their sender banned
        assert all(by_id[m][1].is_banned("peer3") for m in honest)
        hostile_run.cancel()
        # a banned peer is refused by the leader in the next matchmaking
        leader = min(group.members)
        if leader != "peer3":
            outcome = await asyncio.gather(
                *[mm.form_group("r2", {}, expected_size=4) for mm, _ in peers], return_exceptions=True
            )
            assert isinstance(outcome[3], AdmissionRefused)

    asyncio.run(main())


def test_a_banned_member_s_part_is_refused_without_renewing_its_ban(averaging_peers):
    """A reducer that banned a member (e.g. a sender that died mid-part, restarted with its identity) refuses its
    parts until the ban lapses, but does not ban it anew for each refused part: renewed every round, a ban never
    lapsed for a peer that kept averaging, and the restarted peer was locked out of every round."""
    async def main():
        hub = Hub()
        cfg = AllReduceConfig("none", SENDER_TIMEOUT_S, 2 * SENDER_TIMEOUT_S + 2)
        peers = await averaging_peers(hub, [f"peer{i}" for i in range(3)], "b", MatchmakingConfig(3.0, 0.5, 0.05),
                                      cfg, ban_s=60.0)
        bans = {p.matchmaker.peer_id: p.bans for p in peers}
        bans["peer1"].ban("peer2", "sent a part and died")
        until, total = bans["peer1"]._until["peer2"], bans["peer1"].total
        groups = await asyncio.gather(*[mm.form_group("r", {}, expected_size=3) for mm, _ in peers])
        group = groups[0]
        assert set(group.members) == {"peer0", "peer1", "peer2"}
        by_id = {p.matchmaker.peer_id: p.allreduce for p in peers}
        results = await asyncio.gather(*[by_id[m].run(group, torch.full((30,), float(i)), 1.0)
                                         for i, m in enumerate(group.members)], return_exceptions=True)
        for m, res in zip(group.members, results):
            if m != "peer2" and not isinstance(res, BaseException):
                assert "peer2" in res.excluded or m != "peer1"
        assert bans["peer1"]._until["peer2"] == until and bans["peer1"].total == total  # refused, not banned anew

    asyncio.run(main())
