"""Owner-signed DHT records, enforced twice: by every DHT node at store time, and by every reader.

- :class:`OwnerRecordValidator` is a hivemind record validator (``hivemind.DHT(record_validators=[...])``, through
  ``HivemindTransport.create(record_validators=...)``). A DHT node that has it refuses to store, and drops from
  what other nodes return, any record under a subkey ``[owner:<PeerID>]`` that is not an envelope signed by that
  PeerID for that key and expiration (:mod:`peerd.identity.signing`). Other subkeys are not its business (hivemind's
  ``RSASignatureValidator`` works the same way), so non-peerd users of the DHT (``peerd.testing.avgpeer``) are unaffected.
  Every peerd node (workers, bootstrap nodes, ``peerd status``) runs it, so all agree on what is valid.
- :class:`SignedDiscovery` wraps a :class:`protocols.interfaces.Discovery` for the protocols above it: ``store``
  signs (a peer stores only its own records, under its own PeerID), ``get`` returns only records whose signature
  verifies, keyed by their owner's PeerID, and logs (once each) and counts what it dropped. Records under any other
  subkey are dropped too: through this wrapper, every record has an owner who signed it. It is also the one place
  where the DHT backend's failures are named: every read or write that fails raises :class:`DiscoveryError`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any, Awaitable, Optional

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from peerd.identity.signing import (
    InvalidRecord, Signer, claims_owner, key_id, owner_of, owner_subkey, seal, unseal, verify,
)
from protocols.interfaces import Record

logger = logging.getLogger(__name__)

#: Distinct refused records remembered so that each is logged once (a forged record is read on every poll).
_LOGGED_MAX = 4096


class DiscoveryError(ConnectionError):
    """A DHT read or write failed (no node answered, the DHT process stopped, a timeout). Its ``__cause__`` is what
    the backend raised: hivemind's DHT forwards whatever its node raised, so callers catch this one name."""


async def _reach(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except Exception as e:  # boundary: hivemind's DHT (in-process or in its own process) raises untyped errors
        raise DiscoveryError(f"{type(e).__name__}: {e}") from e


class OwnerRecordValidator(RecordValidatorBase):
    """Refuses unsigned or forged writes to ``[owner:<PeerID>]`` subkeys, at store time and on reads.

    Holds no key: peerd signs in :class:`SignedDiscovery`, above the DHT, so ``sign_value``/``strip_value`` keep
    the value as it is. Picklable (hivemind ships validators to its DHT child process).
    """

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # boundary: a peer's record (msgpack raises beyond its UnpackException on garbage)
            return True  # regular values (no subkey) and whole-dictionary tags are not owner records
        if not claims_owner(subkey):
            return True
        try:
            verify(record.key, subkey, MSGPackSerializer.loads(record.value), record.expiration_time)
        except Exception as e:  # boundary: a peer's record; InvalidRecord, or a value that is not even msgpack
            logger.debug("refused DHT record under %s: %s", str(subkey)[:80], e)
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, OwnerRecordValidator)  # one is enough

    def __repr__(self) -> str:
        return "OwnerRecordValidator()"


@dataclasses.dataclass(frozen=True)
class SignedRecord:
    """A verified owner record: the value, its DHT expiration, and the envelope as stored (for re-publishing)."""

    value: Any
    expiration_time: float
    envelope: dict


class SignedDiscovery:
    """:class:`protocols.interfaces.Discovery` in which every record is signed by its owner.

    ``store(key, subkey, ...)`` requires ``subkey`` to be this peer's PeerID and stores the signed envelope under
    ``[owner:<PeerID>]``; ``get(key)`` maps each owner's PeerID to its verified value. ``signer`` None makes a
    read-only view (``peerd status``). ``refused`` counts dropped records by reason.
    """

    def __init__(self, inner: Any, signer: Optional[Signer]):
        self.inner = inner
        self.signer = signer
        self.refused: Counter[str] = Counter()
        self._logged: set[tuple] = set()

    def time(self) -> float:
        return self.inner.time()

    async def store(self, key: str, subkey: str, value: Any, expiration_time: float) -> bool:
        """Sign and store this peer's own record. Raises ValueError for another subkey than our PeerID,
        DiscoveryError if the DHT cannot be written."""
        if self.signer is None or subkey != self.signer.peer_id:
            raise ValueError(f"a peer stores only its own records (subkey {subkey!r} is not our PeerID)")
        envelope = seal(self.signer, key_id(key), value, expiration_time)
        return await _reach(self.inner.store(key, owner_subkey(subkey), envelope, expiration_time))

    def seal_portable(self, key: str, value: Any) -> dict:
        """A portable envelope of ``value`` under ``key`` (no bound expiration): anyone may re-store it."""
        if self.signer is None:
            raise ValueError("a read-only SignedDiscovery cannot sign")
        return seal(self.signer, key_id(key), value, None)

    async def store_portable(self, key: str, owner: str, envelope: dict, expiration_time: float) -> bool:
        """Re-store ``owner``'s portable envelope (e.g. the run's config signed by its creator) until
        ``expiration_time``. Raises InvalidRecord if it is not a valid portable envelope of ``owner``."""
        subkey = owner_subkey(owner)
        if envelope.get("expires") is not None:
            raise InvalidRecord("only portable envelopes (expires = None) can be re-stored by others")
        verify(key_id(key), subkey, envelope, expiration_time)
        return await _reach(self.inner.store(key, subkey, envelope, expiration_time))

    async def get_signed(self, key: str) -> dict[str, SignedRecord]:
        """Owner PeerID -> verified record, for every valid record under ``key``; the rest is dropped and logged.
        Raises DiscoveryError if the DHT cannot be read."""
        kid = key_id(key)
        out: dict[str, SignedRecord] = {}
        for subkey, record in (await _reach(self.inner.get(key))).items():
            owner = owner_of(subkey)
            try:
                if owner is None:
                    raise InvalidRecord("unsigned record (its subkey names no owner)")
                value = unseal(kid, subkey, record.value, record.expiration_time)
            except InvalidRecord as e:
                self._drop(key, subkey, record, e)
                continue
            out[owner] = SignedRecord(value, record.expiration_time, record.value)
        return out

    async def get(self, key: str) -> dict[str, Record]:
        return {owner: Record(r.value, r.expiration_time) for owner, r in (await self.get_signed(key)).items()}

    def _drop(self, key: str, subkey: Any, record: Record, error: InvalidRecord) -> None:
        reason = str(error)
        self.refused[reason.split(" (")[0][:60]] += 1
        signature = record.value.get("signature") if isinstance(record.value, dict) else None
        seen = (key, str(subkey), record.expiration_time, signature if isinstance(signature, bytes) else None)
        if seen in self._logged:
            return
        if len(self._logged) >= _LOGGED_MAX:
            self._logged.clear()
        self._logged.add(seen)
        logger.warning("dropped an invalid record under %s / %s: %s", key, str(subkey)[:80], reason,
                       extra={"event": "record_refused", "key": key, "subkey": str(subkey)[:80], "reason": reason})
