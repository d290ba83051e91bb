"""Bandwidth caps for a volunteer: a token bucket that paces every peer stream, whatever protocol writes to it.

:class:`PacedStreams` wraps any :class:`protocols.interfaces.PeerStreams` (hivemind or in-process): the writers and
readers of streams it opens or serves pay for each chunk from a bucket shared by all streams of the process, one
bucket for upload and one for download. Writes are paced when the protocol awaits ``drain()`` (the writer holds them
until then; every protocol drains after writing a frame). Reads are paced in ``readexactly``, so a capped reader
leaves bytes in the socket buffers and TCP flow control slows the sender down. Rates are in bytes per second;
node configs give MB/s (10^6 bytes).

Each direction also has a :class:`RateMeter`: total bytes, and the rate achieved while transfers were running
(reported in logs, metrics and ``peerd`` control status).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from peerd.transport.uplink import UplinkLease, UplinkMeter, UplinkShares
from protocols.interfaces import PeerStreams, StreamHandler

#: Bytes paid for and moved at a time: small enough for smooth pacing, large enough to keep syscalls cheap.
CHUNK_BYTES = 64 * 1024


class TokenBucket:
    """``rate`` bytes per second with bursts of at most ``burst`` bytes. Callers are served in arrival order.

    A request larger than what the bucket holds is granted once the bucket has been full enough to pay it, which
    leaves the bucket in debt: the long-run rate never exceeds ``rate``.
    """

    def __init__(self, rate: float, burst: Optional[float] = None, clock: Callable[[], float] = time.monotonic):
        if not rate > 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(float(CHUNK_BYTES), self.rate * 0.05)
        if not self.burst > 0:
            raise ValueError(f"burst must be > 0 bytes, got {burst}")
        self._clock = clock
        self._tokens = self.burst
        self._last = clock()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    async def take(self, n: int) -> None:
        """Wait until ``n`` bytes may be moved, then account for them."""
        async with self._lock:
            self._refill()
            need = min(float(n), self.burst)
            if self._tokens < need:
                await asyncio.sleep((need - self._tokens) / self.rate)
                self._refill()
            self._tokens -= n


class RateMeter:
    """Counts bytes and the time transfers were running. A pause longer than ``idle_gap_s`` between two chunks
    ends a busy period, so idle time (training between rounds) does not dilute the achieved rate."""

    def __init__(self, idle_gap_s: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.idle_gap_s = idle_gap_s
        self._clock = clock
        self.total_bytes = 0
        self._busy_s = 0.0
        self._period_start: Optional[float] = None
        self._period_end = 0.0
        self._period_bytes = 0
        self.last_period_bytes = 0
        self.last_period_s = 0.0

    def start(self) -> None:
        """A chunk is about to move (call before waiting for tokens)."""
        now = self._clock()
        if self._period_start is None or now - self._period_end > self.idle_gap_s:
            self._close_period()
            self._period_start, self._period_end, self._period_bytes = now, now, 0

    def done(self, n: int) -> None:
        """``n`` bytes moved."""
        if self._period_start is None:
            self.start()
        self.total_bytes += n
        self._period_bytes += n
        self._period_end = self._clock()

    def _close_period(self) -> None:
        if self._period_start is not None and self._period_end > self._period_start:
            self._busy_s += self._period_end - self._period_start
            self.last_period_bytes = self._period_bytes
            self.last_period_s = self._period_end - self._period_start
        self._period_start = None

    @property
    def busy_s(self) -> float:
        current = (self._period_end - self._period_start) if self._period_start is not None else 0.0
        return self._busy_s + current

    def achieved_rate(self) -> Optional[float]:
        """Bytes per second over all busy periods (None before any transfer)."""
        busy = self.busy_s
        return self.total_bytes / busy if busy > 0 else None


@dataclass
class Direction:
    """One direction's cap (None = unlimited) and meter."""

    bucket: Optional[TokenBucket]
    meter: RateMeter

    async def pay(self, n: int) -> None:
        self.meter.start()
        if self.bucket is not None:
            await self.bucket.take(n)

    def report(self) -> dict[str, Any]:
        return {"limit_bytes_per_s": self.bucket.rate if self.bucket else None, "bytes": self.meter.total_bytes,
                "busy_s": round(self.meter.busy_s, 3), "achieved_bytes_per_s": self.meter.achieved_rate()}


class PacedWriter:
    """A stream writer whose bytes pay the upload bucket before they reach ``inner``."""

    def __init__(self, inner: Any, direction: Direction):
        self._inner = inner
        self._direction = direction
        self._pending: list[memoryview] = []
        self._unpaced = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if not len(view):
            return
        if self._direction.bucket is None:  # unlimited: straight through, only metered
            self._direction.meter.start()
            self._inner.write(view)
            self._unpaced += len(view)
        else:
            self._pending.append(view)

    async def drain(self) -> None:
        if self._unpaced:
            await self._inner.drain()
            self._direction.meter.done(self._unpaced)
            self._unpaced = 0
        while self._pending:
            view = self._pending.pop(0)
            for offset in range(0, len(view), CHUNK_BYTES):
                chunk = view[offset:offset + CHUNK_BYTES]
                await self._direction.pay(len(chunk))
                self._inner.write(chunk)
                await self._inner.drain()
                self._direction.meter.done(len(chunk))
        await self._inner.drain()

    def close(self) -> None:
        if self._unpaced:
            self._direction.meter.done(self._unpaced)
            self._unpaced = 0
        for view in self._pending:  # written but never drained: hand it over unpaced rather than lose it
            self._inner.write(view)
            self._direction.meter.done(len(view))
        self._pending.clear()
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class PacedReader:
    """A stream reader whose ``readexactly`` pays the download bucket, chunk by chunk."""

    def __init__(self, inner: Any, direction: Direction):
        self._inner = inner
        self._direction = direction

    async def readexactly(self, n: int) -> bytes:
        if self._direction.bucket is None or n <= CHUNK_BYTES:
            await self._direction.pay(n)
            data = await self._inner.readexactly(n)
            self._direction.meter.done(n)
            return data
        parts: list[bytes] = []
        remaining = n
        while remaining:
            size = min(CHUNK_BYTES, remaining)
            await self._direction.pay(size)
            try:
                parts.append(await self._inner.readexactly(size))
            except asyncio.IncompleteReadError as e:
                raise asyncio.IncompleteReadError(b"".join(parts) + e.partial, n) from None
            self._direction.meter.done(size)
            remaining -= size
        return b"".join(parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class PacedStreams:
    """:class:`PeerStreams` whose every stream is paced by shared upload/download buckets and metered; with
    ``uplink``, also :class:`protocols.interfaces.UplinkPacing` (each connection paced by the kernel at its share of
    the uplink)."""

    def __init__(self, inner: PeerStreams, upload: Direction, download: Direction,
                 uplink: Optional[UplinkShares] = None):
        self._inner = inner
        self.upload = upload
        self.download = download
        self.uplink = uplink

    @property
    def peer_id(self) -> str:
        return self._inner.peer_id

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        async def paced(peer: str, reader: Any, writer: Any) -> None:
            await handler(peer, PacedReader(reader, self.download), PacedWriter(writer, self.upload))

        await self._inner.add_handler(name, paced)

    async def remove_handler(self, name: str) -> None:
        await self._inner.remove_handler(name)

    async def open(self, peer_id: str, name: str) -> tuple[PacedReader, PacedWriter]:
        reader, writer = await self._inner.open(peer_id, name)
        return PacedReader(reader, self.download), PacedWriter(writer, self.upload)

    def report(self) -> dict[str, dict[str, Any]]:
        """``upload`` and ``download``: each direction's cap and meter (:meth:`Direction.report`); ``uplink``, where
        the connections can be paced: the rate all-reduces pace at shares of (bytes/s; None: not yet measured),
        whether it is ``measured`` rather than declared, and the ``peaks_bytes_per_s`` measured (oldest first)."""
        report = {"upload": self.upload.report(), "download": self.download.report()}
        if self.uplink is not None:
            meter = self.uplink.meter
            report["uplink"] = {"bytes_per_s": self.uplink.next_rate(), "measured": meter is not None,
                                "peaks_bytes_per_s": [round(p) for p in meter.peaks] if meter is not None else []}
        return report

    def pace_uplink(self, shares: Mapping[str, float]) -> Optional[UplinkLease]:
        """:meth:`protocols.interfaces.UplinkPacing.pace_uplink`: None where the streams cannot pace their
        connections, or the uplink's rate is neither declared (``uplink_mb_s``, an upload cap) nor measured."""
        return self.uplink.share(shares) if self.uplink is not None else None


@dataclass
class PacedTransport:
    """What a role is handed: the transport's discovery, and its streams paced."""

    discovery: Any
    streams: PacedStreams


def pace(streams: PeerStreams, upload_bytes_per_s: float = 0.0, download_bytes_per_s: float = 0.0,
         uplink_bytes_per_s: float = 0.0) -> PacedStreams:
    """Wrap ``streams``; a rate of 0 leaves that direction unlimited (still metered). The uplink's rate (bytes/s;
    0: unknown) paces each connection at its share of it where ``streams`` can pace its connections (a ``pace``
    method, :meth:`peerd.transport.direct.DirectStreams.pace`, and ``can_pace`` not False); the upload cap counts
    as the uplink where it is lower. Where neither is known and ``streams`` can tell the kernel's counters of its
    connections (``send_counters``), the uplink is measured (:class:`peerd.transport.uplink.UplinkMeter`)."""
    def direction(rate: float) -> Direction:
        return Direction(TokenBucket(rate) if rate > 0 else None, RateMeter())

    link = min((r for r in (uplink_bytes_per_s, upload_bytes_per_s) if r > 0), default=0.0)
    pace_fn = getattr(streams, "pace", None)
    counters_fn = getattr(streams, "send_counters", None)
    uplink = None
    if callable(pace_fn) and getattr(streams, "can_pace", True):
        if link > 0:
            uplink = UplinkShares(link, pace_fn)
        elif callable(counters_fn):
            uplink = UplinkShares(None, pace_fn, UplinkMeter(counters_fn))
    return PacedStreams(streams, direction(upload_bytes_per_s), direction(download_bytes_per_s), uplink)
