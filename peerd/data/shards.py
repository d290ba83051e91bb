"""A creator's local corpus as content-addressed shards, so volunteers fetch only the shards they train on.

The creator splits its corpus (:func:`split_corpus`: the same bytes, separators and final-5% eval cut as
:func:`peerd.data.corpus.load_corpus`) into shards of ``shard_bytes`` bytes each (the last one of each split
shorter), each named by the SHA-256 of its bytes. A *manifest* lists them: canonical JSON
``{"format": "peerd-shards/1", "name": ..., "shard_bytes": ..., "train": [[digest, bytes], ...], "eval": [...]}``,
itself a blob named by its SHA-256; the run config's ``dataset = "shards:<manifest sha256>"`` names the corpus, so
every peer of a run reads the same bytes. Shards and manifests live in a :class:`ShardStore` (one file per blob,
named by its digest, in ``<checkpoint_dir>/corpus-cache/shards``); peers serve and fetch them with
:mod:`peerd.roles.shard_sync`.

A shard is cut at a fixed byte offset: it may start or end inside a document or a multi-byte character (the byte
tokenizer sees bytes either way; a BPE encodes each shard on its own, an undecodable byte becomes U+FFFD).

Each peer walks the training shards in its own order (:func:`shard_order`, seeded by the run's seed and its
PeerID) and only needs, at any time, the shard it trains on and the next one.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from peerd.data.corpus import DataError, load_corpus, seed_to_int
from peerd.data.corpus_store import memmap_tensor, write_atomic_pieces
from protocols.blobs import DIGEST_RE, sha256_hex

MANIFEST_FORMAT = "peerd-shards/1"
SPEC_PREFIX = "shards:"
DEFAULT_SHARD_BYTES = 16 << 20
"""Default shard size (bytes): ~1.3 s at 100 Mbit/s, ~4 M byte tokens."""
MAX_MANIFEST_BYTES = 16 << 20
"""Largest manifest a peer accepts (bytes): ~200,000 shards."""
_SPEC_RE = re.compile(r"shards:([0-9a-f]{64})")


def parse_shards_spec(spec: str) -> Optional[str]:
    """The manifest digest of a ``dataset`` value ``shards:<64 lowercase hex>``; None for any other dataset
    (``shakespeare``, ``local``, ``hf:NAME``). Raises ValueError for a ``shards:`` value without a valid digest."""
    if not spec.startswith(SPEC_PREFIX):
        return None
    match = _SPEC_RE.fullmatch(spec)
    if match is None:
        raise ValueError(f"dataset {spec!r}: expected shards:<sha256 of the manifest, 64 lowercase hex characters>")
    return match.group(1)


@dataclass(frozen=True)
class ShardManifest:
    """The shards of one corpus; ``train``/``eval`` hold ``(sha256 hex, bytes)`` per shard, in corpus order."""

    name: str
    shard_bytes: int
    train: tuple[tuple[str, int], ...]
    eval: tuple[tuple[str, int], ...]

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): equal manifests have equal bytes, so one digest."""
        return json.dumps({"format": MANIFEST_FORMAT, "name": self.name, "shard_bytes": self.shard_bytes,
                           "train": [list(s) for s in self.train], "eval": [list(s) for s in self.eval]},
                          sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        return sha256_hex(self.to_bytes())

    @property
    def spec(self) -> str:
        """The run config's ``dataset`` value naming this corpus."""
        return SPEC_PREFIX + self.digest

    @classmethod
    def from_bytes(cls, data: bytes) -> "ShardManifest":
        """Parse a manifest (from a peer: every field checked). Raises DataError for anything malformed."""
        try:
            raw = json.loads(data)
            if raw.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, expected {MANIFEST_FORMAT!r}")
            shard_bytes = raw["shard_bytes"]
            if not isinstance(shard_bytes, int) or isinstance(shard_bytes, bool) or shard_bytes < 1:
                raise ValueError(f"shard_bytes {shard_bytes!r}")
            splits = []
            for split in ("train", "eval"):
                entries = []
                for digest, size in raw[split]:
                    if not (isinstance(digest, str) and DIGEST_RE.fullmatch(digest) and isinstance(size, int)
                            and not isinstance(size, bool) and 0 < size <= shard_bytes):
                        raise ValueError(f"{split} shard {digest!r} of {size!r} bytes")
                    entries.append((digest, size))
                splits.append(tuple(entries))
            if not splits[0] or not splits[1]:
                raise ValueError("no train or no eval shard")
            return cls(str(raw["name"]), shard_bytes, splits[0], splits[1])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"malformed shard manifest: {e}") from None


class ShardStore:
    """Blobs (shards and manifests) on disk, one file per blob named by its SHA-256 in ``root``.

    Only verified bytes get a final name (:meth:`put` hashes them; a fetch checks the digest before its rename), so
    a file found under a digest is trusted without hashing it again."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path(self, digest: str) -> Path:
        if not DIGEST_RE.fullmatch(digest):
            raise ValueError(f"malformed digest {digest!r}")
        return self.root / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).exists()

    def put(self, data: bytes | memoryview) -> str:
        """Store ``data`` under its SHA-256 (atomically); returns the digest."""
        digest = sha256_hex(data)
        if not self.has(digest):
            write_atomic_pieces(self.path(digest), iter([bytes(data)]))
        return digest

    def blob(self, digest: str) -> Optional[memoryview | bytes]:
        """The blob's bytes (memory-mapped, read-only), or None if not here or ``digest`` is malformed: the lookup
        of a :class:`protocols.blobs.BlobServer`."""
        try:
            path = self.path(digest)
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return b""
                return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        except (ValueError, OSError):
            return None

    def tokens(self, digest: str) -> torch.Tensor:
        """The shard's bytes as a memory-mapped uint8 tensor (N,). Raises FileNotFoundError if not here."""
        return memmap_tensor(self.path(digest), np.uint8)

    def manifest(self, digest: str) -> Optional[ShardManifest]:
        """The stored manifest with this digest, or None. Raises DataError if the stored bytes are no manifest."""
        data = self.blob(digest)
        return None if data is None else ShardManifest.from_bytes(bytes(data))


def split_corpus(spec: str, store: ShardStore, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 cache_dir: Optional[str | os.PathLike] = None) -> ShardManifest:
    """Split the local corpus ``spec`` (a path or glob, as :func:`peerd.data.corpus.load_corpus` reads it) into
    shards of ``shard_bytes`` bytes in ``store``, store the manifest there too, and return it (its ``spec`` goes
    into the run config). Streams: one shard in memory at a time. Raises DataError (unreadable corpus),
    ValueError (``shard_bytes`` < 1)."""
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
    corpus = load_corpus(spec, cache_dir)
    splits = []
    for data in (corpus.train, corpus.eval):
        raw = data.numpy()
        splits.append(tuple((store.put(raw[i:i + shard_bytes].tobytes()), min(shard_bytes, raw.size - i))
                            for i in range(0, raw.size, shard_bytes)))
    manifest = ShardManifest(os.path.basename(spec.rstrip("/")) or spec, shard_bytes, splits[0], splits[1])
    store.put(manifest.to_bytes())
    return manifest


def shard_order(n_shards: int, peer_id: str, seed: int) -> list[int]:
    """This peer's order of the ``n_shards`` training shards: a permutation of ``range(n_shards)`` that depends only
    on the run's ``seed`` and ``peer_id`` (the same on every restart, another one for every peer)."""
    rng = np.random.default_rng(seed_to_int(f"{seed}/{peer_id}"))
    return [int(i) for i in rng.permutation(n_shards)]


def shards_needed(manifest: ShardManifest, order: Sequence[int], position: int, ahead: int = 1) -> list[str]:
    """Digests a peer at ``position`` of its ``order`` needs: the shard it trains on and the next ``ahead`` ones
    (wrapping around: a peer that used every shard starts over), then every eval shard."""
    n = len(order)
    wanted = [manifest.train[order[(position + k) % n]][0] for k in range(min(ahead + 1, n))]
    return wanted + [d for d, _ in manifest.eval]
