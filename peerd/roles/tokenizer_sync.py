"""Every peer of a run tokenizes with the same file: serve the run's tokenizer, and fetch it where it is missing.

The run config names the tokenizer by digest (:mod:`peerd.data.tokenizer`); this peer's copy lives in its tokenizer cache.
A peer that has the file serves it (:class:`protocols.blobs.BlobServer`, service ``<run>.files``) for as long as it is
in the run; a joiner without it asks the run's live peers (from their status records) one after another until one
delivers bytes with the right digest, and keeps asking (a line every ``log_every_s``) until it gets them or is
stopped: the run's creator may come back online later.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Optional, Union

from peerd.config import ConfigError
from peerd.data.corpus import ByteTokenizer
from peerd.identity.namespace import RunNamespace
from peerd.status.records import StatusFilter
from peerd.data.tokenizer import MAX_TOKENIZER_BYTES, PLACEHOLDER_DIGEST, BpeTokenizer, TokenizerCache, parse_spec
from protocols.blobs import BlobServer, BlobUnavailable, fetch_blob

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 60.0
"""Bound of one fetch from one peer (seconds)."""


def files_service(ns: RunNamespace) -> str:
    """Service name of the run's file server."""
    return ns.prefix("files")


def serve_tokenizers(transport, ns: RunNamespace, cache: TokenizerCache) -> BlobServer:
    """A (not yet started) server of every tokenizer in ``cache``, under the run's files service."""
    return BlobServer(transport, files_service(ns), cache.blob)


async def resolve_tokenizer(spec: str, cache: TokenizerCache, transport, ns: RunNamespace,
                            stop: Optional[asyncio.Event] = None, retry_s: float = 5.0,
                            log_every_s: float = 30.0) -> Union[type[ByteTokenizer], BpeTokenizer, None]:
    """The tokenizer of a run config's ``tokenizer`` spec: :class:`ByteTokenizer` for ``bytes``; the cached BPE,
    or one fetched from the run's live peers (then cached). Returns None if ``stop`` is set before any peer
    delivered it. Raises ValueError for a malformed spec, ConfigError for a preset's placeholder
    (:data:`peerd.data.tokenizer.PLACEHOLDER_DIGEST`)."""
    digest = parse_spec(spec)
    if digest is None:
        return ByteTokenizer
    if digest == PLACEHOLDER_DIGEST:
        reason = ("the run config's tokenizer is the preset's placeholder: train the run's BPE with `peerd tokenizer "
                  "train --data CORPUS` and put the line it prints in the run config")
        raise ConfigError(reason, key="tokenizer", reason=reason)
    cached = cache.get(digest)
    if cached is not None:
        return cached
    got = await wait_for_blob(transport, ns, files_service(ns), digest, MAX_TOKENIZER_BYTES, stop, retry_s,
                              log_every_s, f"the run's tokenizer file ({spec})",
                              f"the run's creator can also copy it to {cache.path(digest)}")
    if got is None:
        return None
    data, peer = got
    tokenizer = BpeTokenizer(data)
    cache.put(tokenizer)
    logger.info("fetched the run's tokenizer (%d tokens, %d bytes) from %s", tokenizer.vocab_size, len(data), peer)
    return tokenizer


async def live_peers(transport, ns: RunNamespace, status_filter: StatusFilter) -> list[str]:
    """The run's live peers other than this one (from their status records), in random order (spreads askers over
    the holders)."""
    peers = [p for p in status_filter(await transport.discovery.get(ns.status_key)) if p != transport.streams.peer_id]
    random.shuffle(peers)
    return peers


async def wait_for_blob(transport, ns: RunNamespace, service: str, digest: str, max_bytes: int,
                        stop: Optional[asyncio.Event], retry_s: float, log_every_s: float, what: str,
                        hint: str) -> Optional[tuple[bytes, str]]:
    """``(bytes, peer)`` of the blob ``digest`` from one of the run's live peers serving ``service``, asking them
    again every ``retry_s`` seconds (a warning naming ``what`` and ``hint`` every ``log_every_s``) until one
    delivers it; None once ``stop`` is set first."""
    status_filter = StatusFilter(logger)
    loop = asyncio.get_running_loop()
    last_log = -float("inf")
    while stop is None or not stop.is_set():
        peers = await live_peers(transport, ns, status_filter)
        try:
            return await fetch_blob(transport, service, peers, digest, max_bytes, FETCH_TIMEOUT_S)
        except BlobUnavailable:
            if loop.time() - last_log >= log_every_s:
                last_log = loop.time()
                logger.warning("%s is not here and no live peer (%d asked) served it yet; waiting (%s)", what,
                               len(peers), hint)
            if stop is None:
                await asyncio.sleep(retry_s)
                continue
            try:
                await asyncio.wait_for(stop.wait(), retry_s)
            except asyncio.TimeoutError:
                pass
    return None


async def fetch_run_tokenizer(spec: str, cache: TokenizerCache, transport, ns: RunNamespace,
                              timeout_s: float = 60.0) -> Union[type[ByteTokenizer], BpeTokenizer]:
    """:func:`resolve_tokenizer` for a short-lived client (``peerd eval`` / ``peerd generate`` through a swarm):
    the cached file, or one fetched from the run's live peers within ``timeout_s`` seconds (then cached).

    Raises:
        ConnectionError: no live peer delivered the file in time (one line for the command to print).
        ValueError: a malformed spec.
    """
    stop = asyncio.Event()
    timer = asyncio.get_running_loop().call_later(timeout_s, stop.set)
    try:
        tokenizer = await resolve_tokenizer(spec, cache, transport, ns, stop, retry_s=min(5.0, timeout_s / 4),
                                            log_every_s=timeout_s)
    finally:
        timer.cancel()
    if tokenizer is None:
        raise ConnectionError(f"no live peer of the run served its tokenizer file ({spec[:20]}...) within "
                              f"{timeout_s:.0f} s")
    return tokenizer
