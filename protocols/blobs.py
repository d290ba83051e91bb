"""Content-addressed files between peers: a peer serves the blobs it holds by their SHA-256, a peer that lacks one
fetches it from any holder and checks the digest before using a byte.

What travels this way is what every peer of a run must hold byte for byte but what is too big for a DHT record (a
run's subword tokenizer, ~0.1-2 MB). A served blob is one RPC reply (:mod:`protocols.rpc` chunks any length); the
fetcher refuses an answer larger than its ``max_bytes`` on the header and an answer whose SHA-256 differs from the
digest it asked for, so a lying peer costs one failed try and never corrupts the fetcher's copy.

Service ``prefix`` (stream handler ``<prefix>.blob``): request header ``{"digest": <64 lowercase hex>}``; answer
payload = the blob's bytes; a peer without the blob refuses with code ``unavailable``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Callable, Optional, Sequence

from protocols.interfaces import Transport
from protocols.rpc import Refused, Request, RpcError, Service, call

logger = logging.getLogger(__name__)

DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    """Lowercase hex SHA-256 of ``data`` (64 characters)."""
    return hashlib.sha256(data).hexdigest()


class BlobUnavailable(Exception):
    """No peer asked could deliver the blob with the wanted digest."""


class BlobServer(Service):
    """Serves ``lookup(digest) -> bytes | None`` under the service name ``prefix``."""

    def __init__(self, transport: Transport, prefix: str, lookup: Callable[[str], Optional[bytes]]):
        self.transport = transport
        self.name = prefix
        self.lookup = lookup
        self.served = 0

    async def rpc_blob(self, request: Request) -> None:
        digest = request.header.get("digest")
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
            raise Refused(f"malformed digest {digest!r}", "bad_request")
        data = self.lookup(digest)
        if data is None:
            raise Refused(f"no blob {digest[:16]}", "unavailable")
        # counted before the bytes leave and taken back if the upload fails: a fetcher holding the blob can already
        # run on while this handler has not resumed after its write (Python 3.12's wait_for, an in-process hub)
        self.served += 1
        try:
            await request.reply({}, data)
        except RpcError as e:
            self.served -= 1
            logger.info("blob upload to %s failed: %s", request.peer, e)


async def fetch_blob(transport: Transport, prefix: str, peers: Sequence[str], digest: str, max_bytes: int,
                     timeout_s: float) -> tuple[bytes, str]:
    """The blob with SHA-256 ``digest`` from the first of ``peers`` that has it, and that peer's ID.

    Each try is bounded by ``timeout_s`` seconds and ``max_bytes`` of payload; a peer that is unreachable, refuses,
    times out or answers with other bytes (logged) is skipped.

    Raises:
        ValueError: ``digest`` is not 64 lowercase hex characters.
        BlobUnavailable: no peer delivered it.
    """
    if not DIGEST_RE.fullmatch(digest):
        raise ValueError(f"malformed digest {digest!r}: expected 64 lowercase hex characters")
    for peer in peers:
        try:
            reply = await call(transport.streams, peer, prefix, "blob", {"digest": digest}, timeout_s=timeout_s,
                               max_reply_bytes=max_bytes)
        except RpcError as e:
            logger.info("blob %s from %s: %s", digest[:16], peer, e)
            continue
        data = bytes(reply.payload)
        if sha256_hex(data) != digest:
            logger.warning("blob %s from %s has another digest: ignored", digest[:16], peer)
            continue
        return data, peer
    raise BlobUnavailable(f"none of {len(peers)} peers delivered blob {digest[:16]}")
