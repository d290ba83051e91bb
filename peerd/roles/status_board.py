"""This peer's status record in the run's DHT namespace, and the records of the others.

One :class:`StatusBoard` per daemon: it publishes the role's status (what ``describe()`` returns, plus the daemon's
``instance``) every ``interval_s`` and on demand, and reads the run's records (schema-checked).

Duplicate identities: every daemon process draws a random ``instance`` id. Two daemons started with the same identity
file share a PeerID, so they overwrite each other's status record. A board that reads, under its own PeerID, a live
record with another instance written after this daemon started stops the daemon (``stop`` is set and
:attr:`StatusBoard.conflict` holds a :class:`DuplicateIdentity`): two such daemons would otherwise each train alone
while the swarm sees one flickering peer. A predecessor that crashed wrote its last record before we started, and
one that left wrote role ``left``: neither counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any, Callable, Optional

from peerd.events import DuplicateIdentitySeen, EventBus
from peerd.status.history import RecentHistory
from peerd.identity.key import IdentityError
from peerd.status.records import StatusFilter, make_status

logger = logging.getLogger(__name__)

#: The status role of a daemon that left the run.
LEFT = "left"


class DuplicateIdentity(IdentityError):
    """Another live daemon uses this peer's identity (same PeerID, other instance)."""


def new_instance() -> str:
    """A random id for this daemon process (64 bits, hex)."""
    return secrets.token_hex(8)


class StatusBoard:
    """Publishes this peer's status record under ``key`` (subkey = ``peer_id``) and reads the run's records.

    ``describe()`` gives the role's current fields (:data:`peerd.runtime.telemetry.STATUS_FIELDS` except ``instance``);
    set it with :meth:`set_source`. ``interval_s``: publication period; ``ttl_s``: lifetime of a record (seconds).
    """

    def __init__(self, discovery: Any, key: str, peer_id: str, interval_s: float, ttl_s: float,
                 stop: asyncio.Event, events: Optional[EventBus] = None, instance: Optional[str] = None,
                 clock: Callable[[], float] = time.time):
        self.discovery = discovery
        self.key = key
        self.peer_id = peer_id
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.stop = stop
        self.events = events
        self.instance = instance or new_instance()
        self.started_at = clock()
        self.conflict: Optional[DuplicateIdentity] = None
        self._describe: Callable[[], dict[str, Any]] = lambda: {"role": "starting"}
        self._filter = StatusFilter(logger)
        self.history = RecentHistory()
        self.reachable: Optional[bool] = None
        """What the dial-back check found (:mod:`protocols.reachability`), carried in every record."""
        self.relayed: Optional[bool] = None
        """Whether this peer holds a circuit relay reservation (found with ``reachable``)."""
        if events is not None:  # the role's events feed the compact history every record carries
            events.subscribe(self.history)

    def set_source(self, describe: Callable[[], dict[str, Any]]) -> None:
        self._describe = describe

    async def publish(self, **override: Any) -> None:
        """Store the current record now (``override`` replaces fields of ``describe()``, e.g. ``role="left"``).
        A failed store is not an error: the next one comes within ``interval_s``."""
        record = make_status(**{"history": self.history.compact(), "reachable": self.reachable,
                                 "relayed": self.relayed, **self._describe(),
                                **override,
                                "instance": self.instance})
        with contextlib.suppress(ConnectionError):  # the DHT unreachable now (DiscoveryError)
            await self.discovery.store(self.key, self.peer_id, record, self.discovery.time() + self.ttl_s)

    async def records(self) -> dict[str, dict]:
        """Status records of the run's peers, any role (PeerID -> record); checks for a duplicate identity."""
        found = self._filter(await self.discovery.get(self.key))
        self._check_own(found.get(self.peer_id))
        return found

    async def run(self) -> None:
        """Publish every ``interval_s`` and look for a duplicate identity, until cancelled. It reads before it
        publishes: what another daemon stored under our PeerID since our last record is still there to be seen."""
        while True:
            with contextlib.suppress(ConnectionError):  # the DHT unreachable now: read again next time
                await self.records()
            await self.publish()
            await asyncio.sleep(self.interval_s)

    def _check_own(self, record: Optional[dict]) -> None:
        if record is None or self.conflict is not None:
            return
        other = record.get("instance")
        if other is None or other == self.instance or record.get("role") == LEFT:
            return
        if not record.get("time", 0) > self.started_at:
            return  # a predecessor's last word (crashed before we started)
        event = DuplicateIdentitySeen(self.peer_id, self.instance, other)
        self.conflict = DuplicateIdentity(event.message())
        if self.events is not None:
            self.events.publish(event)
        else:
            logger.error("%s", event.message(), extra=event.fields())
        self.stop.set()
