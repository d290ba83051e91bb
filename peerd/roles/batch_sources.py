"""A role's batch source, chosen once from the run config (:func:`open_batch_source`), and the source of sharded runs.

``dataset = "shards:<digest>"`` (:class:`ShardBatches`): the peer reads the manifest and the held-out shards (from
its :class:`peerd.data.shards.ShardStore` in ``<checkpoint_dir>/corpus-cache/shards``, or fetched from the run's
live peers by a :class:`peerd.roles.shard_sync.ShardFetcher`), walks the training shards in its own order
(:func:`peerd.data.shards.shard_order`) and draws random windows of the current shard
(:class:`peerd.data.sources.ShardWindows`: as many batches as the shard holds windows' worth of tokens). The shard
after the current one is fetched and tokenized ahead, in a task on the role's event loop; the inner loop waits
(:meth:`ShardBatches.ready`, a line every ``log_every_s``) only if it is not there when the current shard runs out.
The source serves every blob of the store to the run's peers (:func:`peerd.roles.shard_sync.serve_shards`) from
:meth:`ShardBatches.start` to :meth:`ShardBatches.close`: what a peer fetched, the next joiner can fetch from it.

Held-out tokens: the leading eval shards of the manifest, in manifest order, as many as the evaluation reads
(``eval_batches * batch_size`` windows), tokenized as one text: the same on every peer.

Resume: the state is ``(position in the order, batches drawn of that shard)``; the same position reloads the same
shard and reseeds the same windows, so the stream continues bit-identically.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Optional

import torch

from peerd.data.corpus import DataError
from peerd.data.corpus_store import corpus_cache_dir
from peerd.data.hf_stream import parse_hf_spec
from peerd.data.shards import ShardManifest, ShardStore, parse_shards_spec, shard_order
from peerd.data.sources import (BatchSource, HfSource, ShardWindows, WindowBatches, encode_shard,
                                eval_token_count)
from peerd.roles.shard_sync import ShardFetcher, serve_shards
from protocols.blobs import BlobUnavailable

logger = logging.getLogger(__name__)

STATE_KIND = "shards"
RETRY_S = 2.0
"""Seconds between two rounds of asking the live peers for a manifest or shard none of them delivered."""


def shard_store(node) -> ShardStore:
    """The node's shard store: ``<checkpoint_dir>/corpus-cache/shards``."""
    return ShardStore(corpus_cache_dir(node) / "shards")


def open_batch_source(ctx) -> BatchSource:
    """The batch source of the run ``ctx.run`` names (``ctx``: a :class:`peerd.roles.base.RunContext`), drawing
    ``(B, T)`` batches for this peer (seeded by its PeerID). Not started. Raises DataError (a local corpus that
    cannot be read, ``local`` without ``--data``)."""
    run = ctx.run
    if parse_shards_spec(run.dataset) is not None:
        return ShardBatches(run.dataset, shard_store(ctx.node), ctx.transport, ctx.namespace, ctx.tokenizer,
                            run.seq_len, run.batch_size, ctx.peer_id, run.seed, run.eval_batches, ctx.stop,
                            retry_s=RETRY_S)
    name = parse_hf_spec(run.dataset)
    if name is not None:
        return HfSource(name, ctx.tokenizer, run.seq_len, run.batch_size, ctx.peer_id, run.seed, run.eval_batches)
    return WindowBatches(ctx.training_corpus(), run.seq_len, run.batch_size, seed=ctx.peer_id)


class ShardBatches:
    """The batch source of a ``shards:<digest>`` run (see the module)."""

    def __init__(self, spec: str, store: ShardStore, transport, ns, tokenizer, seq_len: int, batch_size: int,
                 peer_id: str, seed: int, eval_batches: int, stop: asyncio.Event, retry_s: float = 5.0,
                 log_every_s: float = 30.0, fetcher: Optional[ShardFetcher] = None):
        """``spec``: ``shards:<manifest digest>``; ``store``: where shards are kept and served from;
        ``stop``: the run's stop (ends every wait). Raises ValueError for a malformed ``spec``."""
        self.spec, self.digest = spec, parse_shards_spec(spec)
        if self.digest is None:
            raise ValueError(f"dataset {spec!r} is not a sharded corpus")
        self.store, self.tokenizer, self.stop = store, tokenizer, stop
        self.seq_len, self.batch_size, self.peer_id, self.seed = seq_len, batch_size, peer_id, seed
        self.eval_need = eval_token_count(seq_len, batch_size, eval_batches)
        self.retry_s, self.log_every_s = retry_s, log_every_s
        self.fetcher = fetcher or ShardFetcher(transport, ns, store)
        self.server = serve_shards(transport, ns, store)
        self.manifest: Optional[ShardManifest] = None
        self.order: list[int] = []
        self.eval_tokens: Optional[torch.Tensor] = None
        self.position, self.drawn = 0, 0
        self.shards_used = 0
        """Shards this source drew batches from (or skipped as too short), counted since it started."""
        self._current: Optional[ShardWindows] = None
        self._loads: dict[int, asyncio.Task] = {}
        self._serving = False

    # -------------------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> bool:
        """Serve the store, read the manifest and the held-out shards, start loading the current shard and the
        next. False if the run's stop came first. Raises DataError (a broken manifest, held-out shards shorter
        than one window)."""
        await self.server.start()
        self._serving = True
        self.manifest = await self.fetcher.manifest(self.spec, self.stop, self.retry_s, self.log_every_s)
        if self.manifest is None:
            return False
        self.order = shard_order(len(self.manifest.train), self.peer_id, self.seed)
        self._load(self.position)
        self._load(self.position + 1)
        eval_tokens = await self._eval_tokens()
        if eval_tokens is None:
            return False
        self.eval_tokens = eval_tokens
        return await self.ready()

    async def close(self) -> None:
        """Cancel the loads ahead and stop serving."""
        tasks = list(self._loads.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a load's own error ends with it
        self._loads.clear()
        if self._serving:
            await self.server.stop()
            self._serving = False

    # ----------------------------------------------------------------------------------------------------- batches

    async def ready(self) -> bool:
        """Wait until the current shard has a batch left (moving to the next shard of the order when it ran out,
        and waiting for it if it is not loaded yet). False if the run's stop came first. Raises DataError if no
        training shard holds one window."""
        if self.manifest is None:
            raise RuntimeError("shard batch source not started")
        empty = 0
        while True:
            current = self._current
            if current is not None and current.position == self.position:
                if current.left > 0:
                    return True
                self.position, self.drawn = self.position + 1, 0
                self.shards_used += 1
                continue
            windows = await self._wait_loaded(self.position)
            if windows is None:
                return False
            self._current = windows
            self._load(self.position + 1)  # the next one ahead, while this one trains
            for old in [p for p in self._loads if p < self.position]:
                self._loads.pop(old).cancel()
            if not windows.batches:
                logger.warning("shard at position %d of the order holds fewer than %d tokens: skipped",
                               self.position, self.seq_len + 1)
                empty += 1
                if empty >= len(self.order):
                    raise DataError(f"no training shard of {self.spec[:23]}... holds one window of "
                                    f"{self.seq_len + 1} tokens: split the corpus into larger shards")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, int64 (B, T), from the current shard. Raises RuntimeError unless :meth:`ready` returned
        True since the last batch."""
        current = self._current
        if current is None or current.position != self.position or current.left <= 0:
            raise RuntimeError("no batch at hand: await ready() first")
        x, y = current.next_batch()
        self.drawn = current.drawn
        return x.long(), y.long()

    def state_dict(self) -> dict:
        """``{"kind": "shards", "manifest", "position", "drawn", "seq_len", "batch_size"}``: plain values."""
        return {"kind": STATE_KIND, "manifest": self.digest, "position": self.position, "drawn": self.drawn,
                "seq_len": self.seq_len, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s shard and batch (before or after :meth:`start`). Raises ValueError for a state of
        another stream (another corpus, sizes or kind)."""
        if state.get("kind") != STATE_KIND or state.get("manifest") != self.digest:
            raise ValueError(f"sampler state is not that of {self.spec[:23]}...")
        for key in ("seq_len", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this source has {getattr(self, key)}")
        self.position, self.drawn = int(state["position"]), int(state["drawn"])
        if self._current is not None and self._current.position == self.position:
            self._current = self._windows(self._current.tokens, self.position)
        else:
            self._current = None
            if self.manifest is not None:
                self._load(self.position)

    # ------------------------------------------------------------------------------------------------ loading

    def _digest_at(self, position: int) -> str:
        return self.manifest.train[self.order[position % len(self.order)]][0]

    def _windows(self, tokens: torch.Tensor, position: int) -> ShardWindows:
        drawn = self.drawn if position == self.position else 0
        return ShardWindows(tokens, position, self.seq_len, self.batch_size, self.peer_id, drawn)

    def _load(self, position: int) -> None:
        """Start fetching and tokenizing the shard at ``position`` (if not already)."""
        if position not in self._loads:
            self._loads[position] = asyncio.ensure_future(self._fetch_tokens(self._digest_at(position)))

    async def _wait_loaded(self, position: int) -> Optional[ShardWindows]:
        self._load(position)
        task = self._loads[position]
        started = time.monotonic()
        while not task.done():
            stopper = asyncio.ensure_future(self.stop.wait())
            try:
                await asyncio.wait({task, stopper}, timeout=self.log_every_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopper.cancel()
            if self.stop.is_set() and not task.done():
                return None
            if not task.done():
                logger.info("training waits for shard %s (position %d of the order): %.0f s so far",
                            self._digest_at(position)[:16], position, time.monotonic() - started)
        tokens = task.result()  # a DataError of the shard's tokens is raised here
        if tokens is None:
            return None
        return self._windows(tokens, position)

    async def _fetch_tokens(self, digest: str) -> Optional[torch.Tensor]:
        """The shard's ids, fetched first if missing (asking again every ``retry_s`` while no peer delivers it);
        None if stopped first."""
        if not await self._fetch([digest], "a training shard"):
            return None
        raw = self.store.tokens(digest)
        if not hasattr(self.tokenizer, "digest"):
            return raw
        return await asyncio.get_running_loop().run_in_executor(None, encode_shard, raw, self.tokenizer)

    async def _fetch(self, digests: list[str], what: str) -> bool:
        logged = float("-inf")
        while True:
            try:
                await self.fetcher.fetch(self.manifest, digests)
                return True
            except (BlobUnavailable, ConnectionError) as e:
                if time.monotonic() - logged >= self.log_every_s:
                    logger.info("no live peer delivered %s yet (%s); asking again every %.0f s", what, e,
                                self.retry_s)
                    logged = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.retry_s)
            if self.stop.is_set():
                return False

    async def _eval_tokens(self) -> Optional[torch.Tensor]:
        """The leading held-out shards' ids, enough for one evaluation (every one if fewer); None if stopped."""
        raw: list[torch.Tensor] = []
        tokens = None
        for digest, _ in self.manifest.eval:
            if not await self._fetch([digest], "a held-out shard"):
                return None
            raw.append(self.store.tokens(digest))
            joined = torch.cat(raw) if len(raw) > 1 else raw[0]
            tokens = await asyncio.get_running_loop().run_in_executor(None, encode_shard, joined, self.tokenizer)
            if tokens.numel() >= self.eval_need:
                break
        if tokens.numel() < self.seq_len + 1:
            raise DataError(f"the held-out shards of {self.spec[:23]}... hold {tokens.numel()} tokens, fewer than "
                            f"one window of {self.seq_len + 1}")
        return tokens
