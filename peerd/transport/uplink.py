"""This peer's uplink shared out between its connections: each paced by the kernel at its share of the link.

The butterfly all-reduce sends to every member of its group at once. Unpaced, those connections take turns
overfilling the bottleneck's queue, lose packets and back off; paced at their shares of the uplink they do not
(``scripts/bench_allreduce.py``, 4 peers at 100 Mbit/s: 0.92 of the link against 0.75-0.78 unpaced;
docs/benchmarks.md). The pace needs the link's rate from below: a rate 10% above the link keeps almost none of the
gain, so it comes from the operator (``uplink_mb_s``, or the upload cap ``upload_limit_mb_s``), never from a
measurement timed at hand-over to the kernel.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional

#: ``pace(peer_id, bytes_per_s or None) -> bool``: :meth:`peerd.transport.direct.DirectStreams.pace`.
PaceFn = Callable[[str, Optional[float]], bool]


class UplinkShares:
    """Paces this peer's connections at their shares of an uplink of ``rate`` bytes/s through ``pace``.

    :meth:`share` takes one run's shares (PeerID -> fraction of the uplink, each in [0, 1]) and returns its
    :class:`UplinkLease`. Runs at once to the same peer add up their shares (a connection carries every run's
    streams to that peer), capped at the whole link; a peer no run holds a share of any more is unpaced again.
    """

    def __init__(self, rate: float, pace: PaceFn):
        if not rate > 0:
            raise ValueError(f"the uplink's rate must be > 0 bytes/s, got {rate}")
        self.rate = float(rate)
        self._pace = pace
        self._leases: set[UplinkLease] = set()

    def share(self, shares: Mapping[str, float]) -> "UplinkLease":
        """Pace each peer of ``shares`` at its share of the uplink (more where other runs hold shares of it too)
        until the lease is closed. Raises ValueError on a share outside [0, 1]; a share of 0 holds nothing."""
        bad = {p: s for p, s in shares.items() if not 0 <= s <= 1}
        if bad:
            raise ValueError(f"shares of the uplink must be in [0, 1], got {bad}")
        lease = UplinkLease(self, {p: float(s) for p, s in shares.items() if s > 0})
        self._leases.add(lease)
        self._apply(lease.shares)
        return lease

    def held(self, peer: str) -> float:
        """The share of the uplink ``peer``'s connections are paced at now (0: unpaced)."""
        return min(1.0, sum(lease.shares.get(peer, 0.0) for lease in self._leases))

    def _apply(self, peers: Iterable[str]) -> None:
        for peer in list(peers):
            share = self.held(peer)
            self._pace(peer, share * self.rate if share > 0 else None)


class UplinkLease:
    """One run's shares of the uplink (:meth:`UplinkShares.share`)."""

    def __init__(self, owner: UplinkShares, shares: dict[str, float]):
        self._owner = owner
        self.shares = shares
        """PeerID -> share this run holds now."""

    def release(self, peer: str) -> None:
        """Everything this run sends to ``peer`` has been handed over: its share goes to the peers this run still
        sends to, in proportion to theirs (so the uplink is not left idle while a slower connection still has
        bytes to move); the last one released leaves ``peer`` unpaced (unless another run holds it)."""
        freed = self.shares.pop(peer, 0.0)
        if self not in self._owner._leases or not freed:
            return
        rest = sum(self.shares.values())
        if rest > 0:
            scale = (rest + freed) / rest
            for other in self.shares:
                self.shares[other] = min(1.0, self.shares[other] * scale)
        self._owner._apply([peer, *self.shares])

    def close(self) -> None:
        """The run is over: every peer it paced is unpaced again (unless another run holds it). Closing twice does
        nothing."""
        if self in self._owner._leases:
            self._owner._leases.discard(self)
            self._owner._apply(self.shares)
