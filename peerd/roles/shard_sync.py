"""Every peer of a ``dataset = "shards:<digest>"`` run reads the creator's corpus: serve the shards held here, fetch
the manifest and the shards this peer's data order needs from the run's live peers.

A peer serves every blob of its :class:`peerd.data.shards.ShardStore` (:class:`protocols.blobs.BlobServer`, service
``<run>.shards``): the creator all of them, a volunteer those it fetched. The manifest is fetched whole, like the
run's tokenizer file (:func:`peerd.roles.tokenizer_sync.wait_for_blob`); a shard is fetched in ranges that resume
after an interruption (:func:`protocols.blobs.fetch_blob_file`), its digest checked before it is used. A peer that
served wrong bytes is skipped for the rest of this fetcher's life and counted in :attr:`ShardFetcher.liars`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional, Sequence

from peerd.data.shards import MAX_MANIFEST_BYTES, ShardManifest, ShardStore, parse_shards_spec
from peerd.identity.namespace import RunNamespace
from peerd.roles.tokenizer_sync import FETCH_TIMEOUT_S, live_peers, wait_for_blob
from peerd.status.records import StatusFilter
from protocols.blobs import BlobServer, fetch_blob_file

logger = logging.getLogger(__name__)

PIECE_BYTES = 1 << 20
"""Bytes per ranged request of a shard (~0.1 s at 100 Mbit/s): the most an interruption costs again."""


def shards_service(ns: RunNamespace) -> str:
    """Service name of the run's shard server."""
    return ns.prefix("shards")


def serve_shards(transport, ns: RunNamespace, store: ShardStore) -> BlobServer:
    """A (not yet started) server of every shard and manifest in ``store``, under the run's shards service."""
    return BlobServer(transport, shards_service(ns), store.blob)


class ShardFetcher:
    """Fetches a sharded run's manifest and shards into ``store`` from the run's live peers."""

    def __init__(self, transport, ns: RunNamespace, store: ShardStore, piece_bytes: int = PIECE_BYTES,
                 timeout_s: float = FETCH_TIMEOUT_S):
        self.transport = transport
        self.ns = ns
        self.store = store
        self.piece_bytes = piece_bytes
        self.timeout_s = timeout_s
        self.liars: set[str] = set()
        """Peers that served bytes other than those asked for; never asked again by this fetcher."""
        self.fetched = 0
        """Shards fetched from peers (not those found in the store)."""
        self._status_filter = StatusFilter(logger)

    async def manifest(self, spec: str, stop: Optional[asyncio.Event] = None, retry_s: float = 5.0,
                       log_every_s: float = 30.0) -> Optional[ShardManifest]:
        """The manifest named by the ``dataset`` value ``spec`` (``shards:<digest>``): the stored one, or one fetched
        from the run's live peers (then stored). None if ``stop`` is set before any peer delivered it.

        Raises:
            ValueError: ``spec`` is not ``shards:<64 lowercase hex>``.
            DataError: the bytes with that digest are no manifest (the run's creator published a broken one).
        """
        digest = parse_shards_spec(spec)
        if digest is None:
            raise ValueError(f"dataset {spec!r} is not a sharded corpus (shards:<digest>)")
        if not self.store.has(digest):
            got = await wait_for_blob(self.transport, self.ns, shards_service(self.ns), digest, MAX_MANIFEST_BYTES,
                                      stop, retry_s, log_every_s, f"the run's shard manifest ({spec[:23]}...)",
                                      f"the run's creator can also copy it to {self.store.path(digest)}")
            if got is None:
                return None
            self.store.put(got[0])
        return self.store.manifest(digest)

    async def fetch(self, manifest: ShardManifest, digests: Sequence[str],
                    peers: Optional[Sequence[str]] = None) -> None:
        """Make every shard in ``digests`` (of ``manifest``) present in the store, fetching those missing from
        ``peers`` (default: the run's live peers, in random order), one after another.

        Raises:
            KeyError: a digest not in ``manifest``.
            BlobUnavailable: no peer (other than known liars) delivered a shard; those fetched so far stay, and a
                partly fetched one resumes on the next call.
        """
        sizes = dict(manifest.train + manifest.eval)
        for digest in digests:
            size = sizes[digest]
            if self.store.has(digest):
                continue
            asked = list(peers) if peers is not None else await live_peers(self.transport, self.ns,
                                                                            self._status_filter)
            self.store.root.mkdir(parents=True, exist_ok=True)
            peer = await fetch_blob_file(self.transport, shards_service(self.ns), asked, digest, size,
                                         str(self.store.path(digest)), self.piece_bytes, self.timeout_s, self.liars)
            self.fetched += 1
            logger.info("fetched shard %s (%d bytes) from %s", digest[:16], size, peer)

