"""Content-addressed files between peers: a peer serves the blobs it holds by their SHA-256, a peer that lacks one
fetches it from any holder and checks the digest before using a byte.

What travels this way is what every peer of a run must hold byte for byte but what is too big for a DHT record (a
run's subword tokenizer, ~0.1-2 MB). A served blob is one RPC reply (:mod:`protocols.rpc` chunks any length); the
fetcher refuses an answer larger than its ``max_bytes`` on the header and an answer whose SHA-256 differs from the
digest it asked for, so a lying peer costs one failed try and never corrupts the fetcher's copy.

A blob too big for one reply (a corpus shard, ~1-64 MiB) is fetched in ranges into a ``.part`` file
(:func:`fetch_blob_file`): an interrupted download resumes where the file ends, and the whole file's SHA-256 is
checked before it takes its final name.

Service ``prefix`` (stream handler ``<prefix>.blob``): request header ``{"digest": <64 lowercase hex>}``, optionally
with ``"offset"`` (int >= 0, bytes) and ``"length"`` (int >= 1, bytes): a range; answer payload = the blob's bytes (of
the range: ``blob[offset:offset + length]``, shorter at the blob's end); a peer without the blob refuses with code
``unavailable``, a malformed request with ``bad_request``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import Callable, Optional, Sequence, Union

from protocols.interfaces import Transport
from protocols.rpc import Refused, Request, RpcError, Service, call

logger = logging.getLogger(__name__)

DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    """Lowercase hex SHA-256 of ``data`` (64 characters)."""
    return hashlib.sha256(data).hexdigest()


class BlobUnavailable(Exception):
    """No peer asked could deliver the blob with the wanted digest."""


BlobBytes = Union[bytes, memoryview]


class BlobServer(Service):
    """Serves ``lookup(digest) -> bytes | memoryview | None`` under the service name ``prefix`` (whole or in ranges;
    a memoryview, e.g. of a memory-mapped file, is sliced without a copy)."""

    def __init__(self, transport: Transport, prefix: str, lookup: Callable[[str], Optional[BlobBytes]]):
        self.transport = transport
        self.name = prefix
        self.lookup = lookup
        self.served = 0

    async def rpc_blob(self, request: Request) -> None:
        digest = request.header.get("digest")
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
            raise Refused(f"malformed digest {digest!r}", "bad_request")
        offset, length = request.header.get("offset", 0), request.header.get("length")
        if not _is_int(offset) or offset < 0 or (length is not None and (not _is_int(length) or length < 1)):
            raise Refused(f"malformed range offset={offset!r} length={length!r}", "bad_request")
        data = self.lookup(digest)
        if data is None:
            raise Refused(f"no blob {digest[:16]}", "unavailable")
        if offset or length is not None:
            data = data[offset:] if length is None else data[offset:offset + length]
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


async def fetch_blob_file(transport: Transport, prefix: str, peers: Sequence[str], digest: str, size: int,
                          path: str, piece_bytes: int, timeout_s: float,
                          liars: Optional[set[str]] = None) -> str:
    """Fetch the blob with SHA-256 ``digest`` and ``size`` bytes into the file ``path``; returns the ID of the peer
    that delivered its last piece.

    The bytes go to ``path + ".part"`` in ranges of ``piece_bytes`` (each try bounded by ``timeout_s`` seconds): a
    part file left by an interrupted fetch is continued where it ends, from whichever peer answers. A peer that is
    unreachable, refuses or times out is left for the next one, the part file kept. When the part file holds
    ``size`` bytes its SHA-256 is checked; only then is it renamed to ``path``. A peer that sent more bytes than
    asked, or that served the whole blob alone and its digest is wrong, has lied: it is added to ``liars``
    (logged) and skipped, as is every peer already in ``liars``. A wrong digest over bytes from several peers (or a
    resumed part) names no one: the part is dropped and the blob fetched again from one peer.

    Raises:
        ValueError: ``digest`` is not 64 lowercase hex characters, ``size`` < 0 or ``piece_bytes`` < 1.
        BlobUnavailable: no peer delivered it (the part file is kept for the next call).
        OSError: ``path`` cannot be written.
    """
    if not DIGEST_RE.fullmatch(digest):
        raise ValueError(f"malformed digest {digest!r}: expected 64 lowercase hex characters")
    if size < 0 or piece_bytes < 1:
        raise ValueError(f"size ({size}) must be >= 0 and piece_bytes ({piece_bytes}) >= 1")
    liars = liars if liars is not None else set()
    part = path + ".part"
    if not os.path.exists(part) or os.path.getsize(part) > size:
        open(part, "wb").close()
    retried: set[str] = set()
    queue = list(peers)
    while queue:
        peer = queue.pop(0)
        if peer in liars:
            continue
        start = have = os.path.getsize(part)
        with open(part, "ab") as out:
            while have < size:
                length = min(piece_bytes, size - have)
                try:
                    reply = await call(transport.streams, peer, prefix, "blob",
                                       {"digest": digest, "offset": have, "length": length}, timeout_s=timeout_s,
                                       max_reply_bytes=length)
                except RpcError as e:
                    logger.info("blob %s from %s at byte %d: %s", digest[:16], peer, have, e)
                    break
                piece = reply.payload
                if len(piece) != length:  # more is refused on the header; fewer before the end is a lie as well
                    logger.warning("blob %s from %s: %d bytes for a range of %d: peer skipped", digest[:16], peer,
                                   len(piece), length)
                    liars.add(peer)
                    break
                out.write(piece)
                have += length
        if have < size:
            continue
        if _file_sha256(part) == digest:
            os.replace(part, path)
            return peer
        open(part, "wb").close()
        if start == 0:
            logger.warning("blob %s from %s has another digest: peer skipped", digest[:16], peer)
            liars.add(peer)
        elif peer not in retried:  # bytes from several peers: fetch it again from this one alone
            retried.add(peer)
            queue.insert(0, peer)
    raise BlobUnavailable(f"none of {len(peers)} peers delivered blob {digest[:16]} ({size} bytes)")
