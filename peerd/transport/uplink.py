"""This peer's uplink shared out between its connections: each paced by the kernel at its share of the link.

The butterfly all-reduce sends to every member of its group at once. Unpaced, those connections take turns
overfilling the bottleneck's queue, lose packets and back off; paced at their shares of the uplink they do not
(``scripts/bench_allreduce.py``, 4 peers at 100 Mbit/s: 0.92 of the link against 0.75-0.78 unpaced;
docs/benchmarks.md). The pace needs the link's rate from below: a rate 10% above the link keeps almost none of the
gain, so it comes from the operator (``uplink_mb_s``, or the upload cap ``upload_limit_mb_s``), never from a
measurement timed at hand-over to the kernel.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

#: ``pace(peer_id, bytes_per_s or None) -> bool``: :meth:`peerd.transport.direct.DirectStreams.pace`.
PaceFn = Callable[[str, Optional[float]], bool]


class UplinkShares:
    """Paces this peer's connections at their shares of an uplink of ``rate`` bytes/s through ``pace``.

    :meth:`share` takes one run's shares (PeerID -> fraction of the uplink, each in [0, 1]) and returns the function
    that gives them back. Runs at once to the same peer add up their shares (a connection carries every run's
    streams to that peer), capped at the whole link; a peer no run holds a share of any more is unpaced again.
    """

    def __init__(self, rate: float, pace: PaceFn):
        if not rate > 0:
            raise ValueError(f"the uplink's rate must be > 0 bytes/s, got {rate}")
        self.rate = float(rate)
        self._pace = pace
        self._held: dict[int, dict[str, float]] = {}
        self._next = 0

    def share(self, shares: Mapping[str, float]) -> Callable[[], None]:
        """Pace each peer of ``shares`` at its share of the uplink (more where other runs hold shares of it too)
        until the returned function is called (once; calling it again does nothing). Raises ValueError on a share
        outside [0, 1]; a share of 0 holds nothing."""
        bad = {p: s for p, s in shares.items() if not 0 <= s <= 1}
        if bad:
            raise ValueError(f"shares of the uplink must be in [0, 1], got {bad}")
        lease = {p: float(s) for p, s in shares.items() if s > 0}
        key, self._next = self._next, self._next + 1
        self._held[key] = lease
        self._apply(lease)

        def give_back() -> None:
            if self._held.pop(key, None) is not None:
                self._apply(lease)

        return give_back

    def held(self, peer: str) -> float:
        """The share of the uplink ``peer``'s connections are paced at now (0: unpaced)."""
        return min(1.0, sum(lease.get(peer, 0.0) for lease in self._held.values()))

    def _apply(self, peers: Mapping[str, float]) -> None:
        for peer in peers:
            share = self.held(peer)
            self._pace(peer, share * self.rate if share > 0 else None)
