"""The run's allowlist, enforced on a role's transport: unlisted peers are neither heard nor seen.

:func:`admit_only` wraps a transport (discovery + peer streams) for a run whose config has an ``allowlist``:

- :class:`AdmissionStreams` refuses every incoming stream (matchmaking joins, all-reduce parts, gossip exchanges,
  state downloads) from a PeerID that is not listed, before the protocol's handler reads a byte: the stream is
  closed and the refusal counted and logged (the first time per peer and handler, then every 100th). It also
  refuses to *open* streams to unlisted peers, so a listed follower never joins an unlisted leader.
- :class:`AllowlistDiscovery` hides records of unlisted PeerIDs (status, matchmaking registrations), so listed
  peers never pick an unlisted leader, partner, or state source, nor wait for one.

The discovery below must already map owners' PeerIDs to records they signed (:class:`peerd.transport.records.
SignedDiscovery`), otherwise anyone could write a record under a listed PeerID.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from protocols.interfaces import Record, StreamHandler

logger = logging.getLogger(__name__)


class AdmissionStreams:
    """:class:`protocols.interfaces.PeerStreams` that talk only to ``allowed`` PeerIDs."""

    def __init__(self, inner: Any, allowed: Iterable[str]):
        self._inner = inner
        self.allowed = frozenset(allowed)
        self.refused: Counter[str] = Counter()  # by remote PeerID

    @property
    def peer_id(self) -> str:
        return self._inner.peer_id

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        async def admitted(peer: str, reader: Any, writer: Any) -> None:
            if peer not in self.allowed:
                self._refuse(peer, name)
                return  # the transport closes the stream: the caller reads EOF
            await handler(peer, reader, writer)

        await self._inner.add_handler(name, admitted)

    async def remove_handler(self, name: str) -> None:
        await self._inner.remove_handler(name)

    async def open(self, peer_id: str, name: str) -> tuple[Any, Any]:
        if peer_id not in self.allowed:
            raise ConnectionRefusedError(f"{peer_id} is not on the run's allowlist")
        return await self._inner.open(peer_id, name)

    def _refuse(self, peer: str, name: str) -> None:
        self.refused[peer] += 1
        count = self.refused[peer]
        if count == 1 or count % 100 == 0:
            logger.warning("refused a %s stream from %s: not on the run's allowlist (%d refused from it)", name, peer,
                           count, extra={"event": "admission_refused", "peer": peer, "handler": name,
                                         "refused": count, "refused_total": sum(self.refused.values())})

    def __getattr__(self, name: str) -> Any:  # report(), upload/download meters of a paced inner transport
        return getattr(self._inner, name)


class AllowlistDiscovery:
    """:class:`protocols.interfaces.Discovery` whose reads keep only records of ``allowed`` PeerIDs."""

    def __init__(self, inner: Any, allowed: Iterable[str]):
        self._inner = inner
        self.allowed = frozenset(allowed)
        self.hidden: Counter[str] = Counter()
        self._logged: set[str] = set()

    def time(self) -> float:
        return self._inner.time()

    async def store(self, key: str, subkey: str, value: Any, expiration_time: float) -> bool:
        return await self._inner.store(key, subkey, value, expiration_time)

    async def get(self, key: str) -> dict[str, Record]:
        records = await self._inner.get(key)
        out = {}
        for peer, record in records.items():
            if peer in self.allowed:
                out[peer] = record
                continue
            self.hidden[peer] += 1
            if peer not in self._logged and len(self._logged) < 1024:
                self._logged.add(peer)
                logger.warning("ignoring records of %s (first under %s): not on the run's allowlist", peer, key,
                               extra={"event": "allowlist_hidden", "peer": peer, "key": key})
        return out


@dataclass
class AdmittedTransport:
    """What a role of an allowlisted run is handed."""

    discovery: AllowlistDiscovery
    streams: AdmissionStreams


def admit_only(transport: Any, allowlist: Iterable[str]) -> Any:
    """``transport`` restricted to ``allowlist``; unchanged if the allowlist is empty (an open run)."""
    allowed = frozenset(allowlist)
    if not allowed:
        return transport
    return AdmittedTransport(AllowlistDiscovery(transport.discovery, allowed),
                             AdmissionStreams(transport.streams, allowed))
