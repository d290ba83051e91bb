"""Signed DHT records: Ed25519 signatures that bind a value to its DHT key, its owner and its expiration.

A peer's PeerID embeds its Ed25519 public key (an identity multihash of the libp2p ``PublicKey`` protobuf), so a
PeerID alone verifies what its owner signed: no key distribution, no certificates.

**Owner records.** A record stored under the subkey ``[owner:<PeerID>]`` (:func:`owner_subkey`; the same idea as
hivemind's ``RSASignatureValidator`` marker ``[owner:<RSA public key>]``) is valid only if its value is an
*envelope* ``{"payload": bytes, "expires": float | None, "signature": bytes}`` whose signature, by that PeerID's key,
covers ``(DOMAIN, DHT key id, subkey, payload, expires)``:

- the key id (hivemind's SHA-1 ``DHTID`` of the key) binds it to one DHT key: a peer's status cannot be replayed as
  its matchmaking record or under another run;
- the subkey binds it to its owner: nobody else can write under ``[owner:X]`` (every peerd DHT node refuses it, see
  :mod:`peerd.transport.records`);
- ``expires`` must equal the record's DHT expiration, so an old record cannot be replayed with a later expiration
  to shadow its owner's newer ones. ``expires = None`` makes a *portable* record that anyone may re-store with any
  expiration: only the run config uses it, so that peers keep their creator's signed config alive after the
  creator left.

The payload is the msgpack encoding of the value; verifiers check the exact bytes they received, so no canonical
re-serialization is needed. This module has no hivemind import; callers pass the key id.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Optional

import base58
import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

#: Signature domain: a peerd record signature can never be mistaken for another protocol's signature.
DOMAIN = "peerd-record/1"
#: PeerID bytes of an Ed25519 key: identity multihash (0x00, length 36) of the PublicKey protobuf
#: (field 1 = key type 1 (Ed25519), field 2 = 32 bytes).
_PEER_ID_PREFIX = b"\x00\x24" + b"\x08\x01\x12\x20"
_PEER_ID_BYTES = len(_PEER_ID_PREFIX) + 32
_OWNER_OPEN, _OWNER_CLOSE = "[owner:", "]"
#: Largest payload accepted in a signed record (bytes); status records are ~200 bytes, run configs ~1 KB.
MAX_PAYLOAD_BYTES = 64 * 1024
ENVELOPE_FIELDS = frozenset({"payload", "expires", "signature"})


class InvalidRecord(ValueError):
    """A record is not a validly signed record of the owner it claims (the message says why)."""


# ------------------------------------------------------------------------------------------------------- PeerIDs


def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The Ed25519 public key embedded in ``peer_id`` (base58, ``12D3KooW...``).

    Raises InvalidRecord if ``peer_id`` is not the PeerID of an Ed25519 key (e.g. an RSA ``Qm...`` PeerID).
    """
    if not isinstance(peer_id, str) or not 40 <= len(peer_id) <= 60:
        raise InvalidRecord(f"{str(peer_id)[:60]!r} is not an Ed25519 PeerID")
    try:
        raw = base58.b58decode(peer_id)
    except ValueError:
        raise InvalidRecord(f"{peer_id!r} is not base58") from None
    if len(raw) != _PEER_ID_BYTES or not raw.startswith(_PEER_ID_PREFIX):
        raise InvalidRecord(f"{peer_id!r} is not an Ed25519 PeerID")
    return Ed25519PublicKey.from_public_bytes(raw[len(_PEER_ID_PREFIX):])


def is_peer_id(value: Any) -> bool:
    """True if ``value`` is the base58 PeerID of an Ed25519 key."""
    try:
        public_key_of(value)
    except InvalidRecord:
        return False
    return True


def peer_id_of_public_key(public: bytes) -> str:
    """PeerID (base58) of a raw 32-byte Ed25519 public key."""
    if len(public) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, got {len(public)}")
    return base58.b58encode(_PEER_ID_PREFIX + public).decode()


def owner_subkey(peer_id: str) -> str:
    """The DHT subkey under which ``peer_id`` keeps its signed records: ``[owner:<PeerID>]``."""
    return f"{_OWNER_OPEN}{peer_id}{_OWNER_CLOSE}"


def owner_of(subkey: Any) -> Optional[str]:
    """The PeerID named by an owner subkey, or None if ``subkey`` is not of the form ``[owner:<Ed25519 PeerID>]``
    (such subkeys are not protected)."""
    if not (isinstance(subkey, str) and subkey.startswith(_OWNER_OPEN) and subkey.endswith(_OWNER_CLOSE)):
        return None
    peer_id = subkey[len(_OWNER_OPEN):-len(_OWNER_CLOSE)]
    return peer_id if is_peer_id(peer_id) else None


def claims_owner(subkey: Any) -> bool:
    """True if ``subkey`` has the owner marker at all (valid PeerID or not): such records are never unprotected."""
    return isinstance(subkey, str) and subkey.startswith(_OWNER_OPEN)


# -------------------------------------------------------------------------------------------------------- signing


class Signer:
    """This peer's Ed25519 identity key: signs its owner records and run configs."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._key = private_key
        self.public_key = private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                                serialization.PublicFormat.Raw)
        self.peer_id = peer_id_of_public_key(self.public_key)

    @classmethod
    def from_identity_file(cls, path: str | os.PathLike) -> "Signer":
        """Load the key of a peerd identity file (libp2p ``PrivateKey`` protobuf: Ed25519, 32-byte seed + 32-byte
        public key; see :mod:`peerd.identity.key`). Raises IdentityError if it is malformed."""
        from hivemind.proto import crypto_pb2

        from peerd.identity.key import IdentityError, peer_id_of

        blob = open(path, "rb").read()
        peer_id = peer_id_of(blob, source=str(path))  # validates type and length
        key = crypto_pb2.PrivateKey.FromString(blob)
        signer = cls(Ed25519PrivateKey.from_private_bytes(key.data[:32]))
        if signer.peer_id != peer_id or key.data[32:] != signer.public_key:
            raise IdentityError(f"{path}: the public half of the key does not match its seed")
        return signer

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


def key_id(key: str) -> bytes:
    """The DHT's 20-byte id of ``key`` (what a DHT node's record validator sees instead of the key): SHA-1 of the
    key's msgpack form, as hivemind's ``DHTID.generate(source=key)`` computes it (tested against it)."""
    return hashlib.sha1(msgpack.packb(key, use_bin_type=True)).digest()


def _message(key_id: bytes, subkey: str, payload: bytes, expires: Optional[float]) -> bytes:
    return msgpack.packb([DOMAIN, key_id, subkey, payload, expires], use_bin_type=True)


def seal(signer: Signer, key_id: bytes, value: Any, expires: Optional[float]) -> dict[str, Any]:
    """The envelope of ``value`` stored by ``signer`` under (``key_id``, ``owner_subkey(signer.peer_id)``).

    ``expires`` must be the DHT expiration the record is stored with, or None for a portable record.
    Raises ValueError if the value does not serialize or is larger than MAX_PAYLOAD_BYTES.
    """
    payload = msgpack.packb(value, use_bin_type=True)
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"signed record payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    expires = None if expires is None else float(expires)
    signature = signer.sign(_message(key_id, owner_subkey(signer.peer_id), payload, expires))
    return {"payload": payload, "expires": expires, "signature": signature}


def verify(key_id: bytes, subkey: Any, envelope: Any, expiration_time: float) -> bytes:
    """Check that ``envelope``, found under (``key_id``, ``subkey``) with ``expiration_time``, was signed by the
    owner that ``subkey`` names. Returns the payload bytes.

    Raises InvalidRecord (saying why) for: a subkey without a valid owner, a value that is not an envelope
    (unsigned, wrong schema, extra fields), a payload over MAX_PAYLOAD_BYTES, an expiration other than the signed
    one, or a signature that does not verify (forged, altered, or signed for another key or owner).
    """
    owner = owner_of(subkey)
    if owner is None:
        raise InvalidRecord(f"subkey {str(subkey)[:80]!r} names no Ed25519 owner")
    if not isinstance(envelope, dict) or set(envelope) != ENVELOPE_FIELDS:
        raise InvalidRecord("value is not a signed envelope (unsigned or wrong schema)")
    payload, expires, signature = envelope["payload"], envelope["expires"], envelope["signature"]
    if not isinstance(payload, bytes) or len(payload) > MAX_PAYLOAD_BYTES:
        raise InvalidRecord("payload is not bytes or is too large")
    if not isinstance(signature, bytes) or len(signature) != 64:
        raise InvalidRecord("signature is not 64 bytes")
    if expires is not None:
        if not isinstance(expires, float) or not math.isfinite(expires):
            raise InvalidRecord("expires is not a finite float")
        if expires != expiration_time:
            raise InvalidRecord(f"stored with expiration {expiration_time}, signed for {expires} (replayed)")
    try:
        public_key_of(owner).verify(signature, _message(key_id, subkey, payload, expires))
    except InvalidSignature:
        raise InvalidRecord(f"signature does not verify with the key of {owner}") from None
    return payload


def unseal(key_id: bytes, subkey: Any, envelope: Any, expiration_time: float) -> Any:
    """:func:`verify`, then decode the payload. Raises InvalidRecord."""
    payload = verify(key_id, subkey, envelope, expiration_time)
    try:
        return msgpack.unpackb(payload, raw=False)
    except Exception as e:  # boundary: a peer's bytes; msgpack's docs: unpack "may raise" beyond UnpackException
        raise InvalidRecord(f"payload does not decode: {e}") from None
