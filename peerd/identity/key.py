"""Persistent peer identity: an Ed25519 private key file that keeps the PeerID stable across restarts.

The file holds a libp2p ``PrivateKey`` protobuf (key type Ed25519, 64 bytes: 32-byte seed then 32-byte public key),
the format the libp2p daemon reads with ``-id``. It is created on first use with mode 0600; an existing file with
looser permissions is refused, because anyone who can read it can impersonate this peer.

A running daemon holds its identity file with :func:`hold_identity`: two daemons with one identity would share a
PeerID (each dialing itself, neither seeing the other), so the second one is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

import base58
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError
from hivemind.proto import crypto_pb2

_IDENTITY_MULTIHASH = b"\x00"  # multihash code 0x00 (identity): keys up to 42 bytes are embedded in the PeerID


class IdentityError(RuntimeError):
    """The identity file is unreadable, malformed or readable by others, or another daemon uses it."""


class IdentityInUse(IdentityError):
    """Another live daemon holds this identity file."""


class IdentityHold:
    """The lock on an identity file, held until :meth:`release` (or this process's death)."""

    def __init__(self, path: Path, fd: Optional[int]):
        self.path = path
        self._fd = fd

    def release(self) -> None:
        """Unlock (idempotent)."""
        from peerd.runtime import locks

        if self._fd is None:
            return
        locks.release(self._fd)
        self._fd = None


def hold_identity(path: str | os.PathLike) -> IdentityHold:
    """Lock ``path`` for this daemon (``flock`` on ``<path>.lock``, created beside it with its folder, mode 0700).

    Raises IdentityInUse, naming the file and the holder's pid, if another daemon holds it; IdentityError if the
    lock file cannot be created."""
    from peerd.runtime import locks

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = locks.acquire(path.with_name(path.name + ".lock"))
    except locks.LockHeld as e:
        who = f"pid {e.pid}" if e.pid is not None else "pid unknown"
        raise IdentityInUse(
            f"identity file {path} is in use by another peerd daemon ({who}); two daemons with one identity share "
            "a PeerID: give this one its own with --identity PATH (node config key identity)"
        ) from None
    except OSError as e:
        raise IdentityError(f"cannot lock identity file {path}: {e}") from None
    return IdentityHold(path, fd)


def load_or_create_identity(path: str | os.PathLike) -> str:
    """Ensure an Ed25519 identity exists at ``path``; returns its PeerID (base58, ``12D3KooW...``).

    Creates parent folders (mode 0700) and the key file (mode 0600) atomically on first use.
    Raises IdentityError if the file exists but is malformed, not Ed25519, or group/world-accessible.
    """
    path = Path(path)
    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise IdentityError(f"identity file {path} has mode {mode:o}; run `chmod 600 {path}`")
        return peer_id_of(path.read_bytes(), source=str(path))
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=seed + public).SerializeToString()
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, blob)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return peer_id_of(blob, source=str(path))


def peer_id_of(blob: bytes, source: str = "identity") -> str:
    """PeerID (base58) of a serialized libp2p Ed25519 ``PrivateKey``."""
    try:
        key = crypto_pb2.PrivateKey.FromString(blob)
    except DecodeError as e:
        raise IdentityError(f"{source}: not a libp2p private key ({e})") from None
    if key.key_type != crypto_pb2.KeyType.Ed25519 or len(key.data) != 64:
        raise IdentityError(f"{source}: expected an Ed25519 key, got key type {key.key_type}")
    public = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=key.data[32:]).SerializeToString()
    return base58.b58encode(_IDENTITY_MULTIHASH + bytes([len(public)]) + public).decode()
