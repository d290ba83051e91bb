"""Persistent Ed25519 identity: file creation and permissions, malformed files, libp2p PeerID derivation."""

import os
import stat

import base58
import multihash
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from peerd.identity.key import IdentityError, IdentityInUse, hold_identity, load_or_create_identity, peer_id_of

pytestmark = pytest.mark.timeout(60)

# libp2p PublicKey protobuf of an Ed25519 key: field 1 (varint) = 1 (Ed25519), field 2 (bytes) of length 32
ED25519_PUBLIC_PREFIX = b"\x08\x01\x12\x20"
# identity multihash (code 0x00) of a 36-byte payload
IDENTITY_MULTIHASH_PREFIX = b"\x00\x24"


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def expected_peer_id_bytes(key_file_bytes: bytes) -> bytes:
    """The PeerID bytes libp2p derives, computed from the seed alone with an independent Ed25519 implementation."""
    key = crypto_pb2.PrivateKey.FromString(key_file_bytes)
    seed = key.data[:32]
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return IDENTITY_MULTIHASH_PREFIX + ED25519_PUBLIC_PREFIX + public


def test_first_call_creates_a_private_key_file(tmp_path):
    path = tmp_path / "keys" / "identity.key"
    peer_id = load_or_create_identity(path)
    assert path.is_file()
    assert mode_of(path) == 0o600
    assert mode_of(path.parent) & 0o077 == 0
    assert peer_id.startswith("12D3KooW")
    # no temporary file remains next to it
    assert sorted(p.name for p in path.parent.iterdir()) == ["identity.key"]
    key = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    assert key.key_type == crypto_pb2.KeyType.Ed25519 and len(key.data) == 64


def test_second_call_returns_the_same_peer_id_and_keeps_the_file(tmp_path):
    path = tmp_path / "identity.key"
    first = load_or_create_identity(path)
    blob = path.read_bytes()
    second = load_or_create_identity(str(path))
    assert second == first
    assert path.read_bytes() == blob
    assert mode_of(path) == 0o600


def test_different_files_are_different_identities(tmp_path):
    assert load_or_create_identity(tmp_path / "a.key") != load_or_create_identity(tmp_path / "b.key")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_group_or_world_accessible_file_is_refused(tmp_path, mode):
    path = tmp_path / "identity.key"
    load_or_create_identity(path)
    blob = path.read_bytes()
    os.chmod(path, mode)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(path)
    # the key is left as it was (not regenerated, not rewritten)
    assert path.read_bytes() == blob


def test_owner_only_modes_are_accepted(tmp_path):
    path = tmp_path / "identity.key"
    peer_id = load_or_create_identity(path)
    os.chmod(path, 0o400)
    assert load_or_create_identity(path) == peer_id


@pytest.mark.parametrize(
    "blob",
    [
        b"this is not a key at all \xff\xfe",
        b"",
        # a valid protobuf, but an RSA key
        crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=b"\x01" * 64).SerializeToString(),
        # Ed25519, but the wrong length (32-byte seed without the public half)
        crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"\x01" * 32).SerializeToString(),
    ],
    ids=["garbage", "empty", "rsa", "short-ed25519"],
)
def test_malformed_file_is_refused(tmp_path, blob):
    path = tmp_path / "identity.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, blob)
    os.close(fd)
    with pytest.raises(IdentityError, match=str(path)):
        load_or_create_identity(path)


def test_peer_id_is_the_libp2p_identity_multihash_of_the_public_key(tmp_path):
    path = tmp_path / "identity.key"
    peer_id = load_or_create_identity(path)
    blob = path.read_bytes()
    raw = PeerID.from_base58(peer_id).to_bytes()
    # Ed25519 public keys are small enough for libp2p to inline them: identity multihash, 36-byte protobuf key
    assert raw[:2] == IDENTITY_MULTIHASH_PREFIX and len(raw) == 2 + 36
    assert raw == expected_peer_id_bytes(blob)
    decoded = multihash.decode(raw)
    assert decoded.func == multihash.Func.identity and len(decoded.digest) == 36
    public = crypto_pb2.PublicKey.FromString(decoded.digest)
    assert public.key_type == crypto_pb2.KeyType.Ed25519
    # the stored public half is the one the seed derives (what p2pd signs with matches what the PeerID claims)
    assert public.data == crypto_pb2.PrivateKey.FromString(blob).data[32:]
    assert PeerID(raw).to_base58() == peer_id == base58.b58encode(raw).decode()


def test_peer_id_of_a_known_key():
    """A fixed seed gives a fixed PeerID (what fixtures with stable identities rely on)."""
    seed = bytes(range(32))
    key = Ed25519PrivateKey.from_private_bytes(seed)
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=seed + public).SerializeToString()
    peer_id = peer_id_of(blob)
    assert peer_id.startswith("12D3KooW")
    assert PeerID.from_base58(peer_id).to_bytes() == expected_peer_id_bytes(blob)
    assert peer_id_of(blob) == peer_id


def test_peer_id_of_garbage_raises_identity_error():
    with pytest.raises(IdentityError, match="my-source"):
        peer_id_of(b"\xff" * 10, source="my-source")


def test_a_held_identity_is_refused_to_a_second_daemon_naming_the_file_and_the_holder(tmp_path):
    path = tmp_path / "state" / "identity.key"
    first = hold_identity(path)
    try:
        with pytest.raises(IdentityInUse) as info:
            hold_identity(path)
        message = str(info.value)
        assert str(path) in message and f"pid {os.getpid()}" in message and "--identity" in message
        assert len(message.splitlines()) == 1
    finally:
        first.release()
    hold_identity(path).release()  # released: the next daemon gets it


def test_a_forked_child_does_not_keep_the_identity_lock(tmp_path):
    """hivemind forks its DHT process while the daemon holds the lock: an orphaned child must not keep it."""
    path = tmp_path / "identity.key"
    held = hold_identity(path)
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child outlives the parent's hold and waits for the parent to say it may exit
        os.close(write_end)
        os.write(ready_write, b"r")  # os.fork() has returned here: the at-fork hooks have run
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    os.close(ready_write)
    try:
        assert os.read(ready_read, 1) == b"r"
        held.release()
        hold_identity(path).release()  # would raise IdentityInUse if the child had kept the locked descriptor
    finally:
        os.write(write_end, b"x")
        os.close(write_end)
        os.close(ready_read)
        os.waitpid(pid, 0)
