"""Part scheduling of the butterfly: how many values each member reduces (equal, bandwidth-proportional, none for a
dial-only member) and the link rates a peer measures from its own runs and announces for that."""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from itertools import accumulate
from statistics import median
from typing import Any, Optional, Sequence

from protocols.allreduce.config import AllReduceConfig
from protocols.matchmaking import Group
from protocols.partition import partition_sizes, proportional_sizes, valid_rate


#: Announced rates that differ by less than this factor give equal parts (bandwidth partition only).
RATE_SPREAD = 1.5
#: A member's announced rates are the median of its last RATE_HISTORY measured runs...
RATE_HISTORY = 5
#: ...and are announced only once RATE_MIN_RUNS runs were measured (before that: equal parts).
RATE_MIN_RUNS = 3
#: A run's measurement counts only if it moved at least this many bytes each way: short transfers measure latency
#: and the event loop, not the link.
RATE_MIN_BYTES = 4 << 20
#: ...and only its streams of at least this many bytes count: a shorter one is "done" once it sits in the buffers
#: (the socket's unsent bytes, the path's in-flight ones), so its bytes over its duration measure them, not the link
#: (a floor part of a 12.5 MB vector, 195 KB, read a 20 Mbit/s uplink as 9-68 MB/s).
RATE_MIN_STREAM_BYTES = 1 << 20
#: With bandwidth-proportional parts, every member within partition.FLOOR_SPREAD of the fastest reduces at least
#: MIN_SHARE of an equal part, so that every honest reducer validates (and can exclude) every sender. Validating
#: needs a part, not a large one; the floor costs the slowest member at most a factor 1 + (N - 2) / N * MIN_SHARE
#: of the optimal time (4 peers: 3.1%; any N: < 6.25%; docs/architecture.md "Parts by bandwidth").
MIN_SHARE = 1 / 16


def announced_rates(members: Sequence[str], infos: Any) -> Optional[list[float]]:
    """``min(up, down)`` (bytes/s) that each of ``members`` announced under ``rates`` in its group info (``infos``:
    member -> info dict, untrusted), in the order of ``members``; None where one did not announce valid rates
    (:func:`protocols.partition.valid_rate`)."""
    infos = infos if isinstance(infos, dict) else {}
    rates = []
    for member in members:
        info = infos.get(member)
        announced = info.get("rates") if isinstance(info, dict) else None
        if not isinstance(announced, dict):
            return None
        up, down = valid_rate(announced.get("up")), valid_rate(announced.get("down"))
        if up is None or down is None:
            return None
        rates.append(min(up, down))
    return rates


#: One stream of a run as :meth:`PartPlanner._measure` takes it: ``(seconds since the run's start, bytes)`` of each of
#: its chunks, in order (a chunk counts once handed to the transport going up, once arrived going down).
TimedStream = Sequence[tuple[float, int]]


def link_rate(streams: Sequence[TimedStream]) -> tuple[float, int]:
    """``(rate in bytes/s, bytes counted)`` of one direction of this peer's link, from the streams one run moved that
    way; (0.0, 0) if none counts. Streams under :data:`RATE_MIN_STREAM_BYTES` do not count.

    The rate is the largest, over the counted streams' end times t, of every counted byte moved by t (the other
    streams' chunks so far included) over t. Up to the first stream's end all streams share the link, so a link that
    is the bottleneck reads at its rate; taking the largest keeps a fast link from reading as slow as a stream
    slowed by the other end's link (it ends last, when little else moves). Summing each stream's bytes over its own
    duration instead (the estimate before) over-reads a link whose streams end at different times: each counts at
    its average pace, as if the others had not sped up once the first ended (a 20 Mbit/s link, 2.5 MB/s, read
    2.0-3.4 MB/s that way)."""
    counted = [s for s in streams if sum(b for _, b in s) >= RATE_MIN_STREAM_BYTES]
    chunks = sorted((t, b) for s in counted for t, b in s)
    times = [t for t, _ in chunks]
    moved = list(accumulate(b for _, b in chunks))  # bytes moved by each chunk's time
    rate = max((moved[bisect_right(times, s[-1][0]) - 1] / s[-1][0] for s in counted if s[-1][0] > 0), default=0.0)
    return rate, moved[-1] if moved else 0


def connection_shares(sizes: Sequence[int], me: int) -> list[float]:
    """Each connection's share of member ``me``'s upload in a butterfly with parts ``sizes`` (values, in member
    order): to member j go our slice of j's part and our part's answer, ``sizes[j] + sizes[me]`` values; 0 for
    ourselves (and for everyone where nothing is sent)."""
    load = [0 if j == me else size + sizes[me] for j, size in enumerate(sizes)]
    total = sum(load)
    return [x / total if total else 0.0 for x in load]


class PartPlanner:
    """The part-scheduling side of :class:`protocols.allreduce.ButterflyAllReduce` (a mixin): what this peer announces
    in the group info, the part sizes every member computes alike from the group, and the rate measurement."""

    config: AllReduceConfig

    def __init__(self) -> None:
        self.dial_only = False
        """This peer cannot be dialed directly (behind a NAT): announced in the group info, it then reduces no part
        while another member can (:meth:`part_sizes`); it still sends its own parts, dialing out. Set it per round."""
        self.rates: Optional[dict[str, float]] = None
        """This peer's rates in bytes/s, ``{"up", "down"}``: set by the operator, or measured from the all-reduce's
        own transfers: the median of the last :data:`RATE_HISTORY` runs that moved at least :data:`RATE_MIN_BYTES`
        each way in streams of :data:`RATE_MIN_STREAM_BYTES` or more, once there are :data:`RATE_MIN_RUNS` of them
        (a median: one run slowed or sped up by other load on the host does not move it). A run's estimate is
        :func:`link_rate` of its streams each way. Up: our slices of the others' parts. Down: the members' slices of
        our part and the answers of their parts (a member that reduces nothing still measures both). Our answers
        as a reducer do not count up: they leave at the pace of the slowest sender, not of our link, and a floor
        part's answers are short streams."""
        self._rate_history: deque = deque(maxlen=RATE_HISTORY)

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
            rates = announced_rates(members, infos)
            # rates within RATE_SPREAD of each other are measurement noise: equal parts are as good, and stable
            if rates is not None and sum(rates) > 0 and max(rates) > RATE_SPREAD * min(rates):
                return proportional_sizes(numel, rates, MIN_SHARE)
        return partition_sizes(numel, len(members))

    def _measure(self, uploads: Sequence[TimedStream], downloads: Sequence[TimedStream]) -> None:
        """Fold one run's streams each way into :attr:`rates` (bytes/s): see there."""
        up, up_bytes = link_rate(uploads)
        down, down_bytes = link_rate(downloads)
        if up <= 0 or down <= 0 or up_bytes < RATE_MIN_BYTES or down_bytes < RATE_MIN_BYTES:
            return
        self._rate_history.append((up, down))
        if len(self._rate_history) >= RATE_MIN_RUNS:
            self.rates = {"up": median(u for u, _ in self._rate_history),
                          "down": median(d for _, d in self._rate_history)}
