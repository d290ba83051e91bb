"""Where a training peer's batches come from: one *batch source* per kind of ``dataset``, behind one interface.

A batch source (:class:`BatchSource`) hands the inner loop int64 ``(x, y)`` batches of shape (B, T), its position
as plain values for the checkpoint (``state_dict`` / ``load_state_dict``: a resumed peer continues the same stream)
and the run's held-out tokens (``eval_tokens``). Some sources need the network or a slow read before a batch is
there, so a source has an async life too: :meth:`BatchSource.start` (after ``load_state_dict`` on a resume; fetches
what the first batches and the evaluation need), :meth:`BatchSource.ready` (awaited before each ``next_batch``: it
returns at once while the next batch is at hand, and waits, with progress logged, only when it is truly not there
yet) and :meth:`BatchSource.close`.

The kinds (chosen once from the run config by :func:`peerd.roles.batch_sources.open_batch_source`):

- ``shakespeare`` / ``local``: :class:`WindowBatches`, random windows of the whole corpus
  (:class:`peerd.data.corpus.WindowSampler`, unchanged);
- ``shards:<digest>``: :class:`peerd.roles.batch_sources.ShardBatches`, random windows of one shard after another
  in this peer's shard order, the shards fetched from peers (:class:`ShardWindows` draws them);
- ``hf:NAME``: :class:`HfSource`, documents streamed with ``datasets`` and packed into windows
  (:class:`peerd.data.hf_stream.HfBatches`).
"""

from __future__ import annotations

import asyncio
from typing import Optional, Protocol

import torch

from peerd.data.corpus import DOC_SEPARATOR, Corpus, DataError, WindowSampler
from peerd.data.hf_stream import HfBatches, open_stream


class BatchSource(Protocol):
    """What a training loop draws its batches from (see the module)."""

    eval_tokens: Optional[torch.Tensor]
    """The run's held-out tokens, 1-D (N,), the same on every peer; None until :meth:`start` returned True."""

    async def start(self) -> bool:
        """Prepare the first batches and ``eval_tokens``; False if the run's stop came first."""

    async def ready(self) -> bool:
        """Wait until :meth:`next_batch` can run without waiting on the network; False if the run's stop came first
        (then ``next_batch`` must not be called)."""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: int64 (B, T) inputs and next-token targets. May run in a worker thread."""

    def state_dict(self) -> dict:
        """The stream's position, plain Python values."""

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream of ``state``. Raises ValueError for a state of another stream."""

    async def close(self) -> None:
        """Stop background work and services."""


class WindowBatches:
    """``shakespeare`` and ``local`` runs: random windows of the whole tokenized corpus, exactly as
    :class:`peerd.data.corpus.WindowSampler` draws them (``state_dict`` is the sampler's own)."""

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, seed: int | str):
        """``corpus``: tokenized (:func:`peerd.data.corpus.tokenize_corpus`). Raises ValueError (see
        :class:`WindowSampler`)."""
        self.sampler = WindowSampler(corpus.train, seq_len, batch_size, seed=seed)
        self.eval_tokens = corpus.eval

    @property
    def tokens(self) -> torch.Tensor:
        """The training tokens, (N,)."""
        return self.sampler.tokens

    async def start(self) -> bool:
        return True

    async def ready(self) -> bool:
        return True

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sampler.next_batch()

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    async def close(self) -> None:
        pass


def batches_in(tokens: int, seq_len: int, batch_size: int) -> int:
    """Batches drawn from a shard of ``tokens`` tokens: as many as it holds windows of ``seq_len + 1`` tokens,
    ``batch_size`` per batch, at least 1; 0 for a shard shorter than one window."""
    if tokens < seq_len + 1:
        return 0
    return max(1, tokens // (batch_size * (seq_len + 1)))


class ShardWindows:
    """Random windows of one shard's tokens: :func:`batches_in` batches, drawn by a
    :class:`peerd.data.corpus.WindowSampler` seeded by ``(peer_id, position)`` (position in this peer's shard order,
    counted across epochs), so a resume at ``(position, drawn)`` draws the same batches again."""

    def __init__(self, tokens: torch.Tensor, position: int, seq_len: int, batch_size: int, peer_id: str,
                 drawn: int = 0):
        """``tokens``: the shard's ids, 1-D (N,). ``drawn``: batches of this shard already drawn (skipped)."""
        self.position = position
        self.tokens = tokens
        self.batches = batches_in(tokens.numel(), seq_len, batch_size)
        self.drawn = 0
        self._sampler = None
        if self.batches:
            self._sampler = WindowSampler(tokens, seq_len, batch_size, seed=f"{peer_id}/shard-position/{position}")
            self.skip(drawn)

    def skip(self, count: int) -> None:
        """Draw ``count`` batches' offsets without building the batches."""
        if count:
            state = self._sampler.state_dict()
            state["batches_drawn"] = count
            self._sampler.load_state_dict(state)
            self.drawn = count

    @property
    def left(self) -> int:
        return self.batches - self.drawn

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, int64 (B, T). Raises RuntimeError once :attr:`batches` were drawn."""
        if self.left <= 0:
            raise RuntimeError(f"shard at position {self.position} has no batch left")
        self.drawn += 1
        return self._sampler.next_batch()


def encode_shard(raw: torch.Tensor, tokenizer) -> torch.Tensor:
    """A shard's ids: its bytes (uint8, (N,)) as they are for the byte tokenizer; for a BPE the text (bad UTF-8 at
    the cuts -> U+FFFD) split into documents at the blank-line separator and encoded, int32 (M,)."""
    if not hasattr(tokenizer, "digest"):
        return raw
    text = raw.numpy().tobytes().decode("utf-8", errors="replace")
    return tokenizer.encode_documents(text.split(DOC_SEPARATOR), DOC_SEPARATOR)


def eval_token_count(seq_len: int, batch_size: int, eval_batches: int) -> int:
    """Held-out tokens an evaluation reads: ``eval_batches`` batches of ``batch_size`` windows of ``seq_len + 1``
    tokens, consecutive and non-overlapping (:func:`peerd.data.corpus.evaluate`); one window at least."""
    return max(1, eval_batches * batch_size) * seq_len + 1


class HfSource:
    """``hf:NAME`` runs: :class:`peerd.data.hf_stream.HfBatches` over every data file but the last, which is held
    out: ``eval_tokens`` are its first documents (as many as the evaluation reads), the same on every peer.

    The stream is opened in a worker thread on :meth:`start`, and :meth:`ready` builds the next batch in a worker
    thread too (a Hub dataset is read over the network), so the event loop never waits on the stream. Resume: see
    :class:`HfBatches` (exact for unchanged files and tokenizer)."""

    def __init__(self, name: str, tokenizer, seq_len: int, batch_size: int, peer_id: str, seed: int,
                 eval_batches: int):
        self.name, self.tokenizer = name, tokenizer
        self.seq_len, self.batch_size, self.peer_id, self.seed = seq_len, batch_size, peer_id, seed
        self.eval_need = eval_token_count(seq_len, batch_size, eval_batches)
        self.eval_tokens: Optional[torch.Tensor] = None
        self.batches: Optional[HfBatches] = None
        self._state: Optional[dict] = None  # loaded before start, or the state before the pending batch
        self._pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def _open(self) -> None:
        stream = open_stream(self.name)
        n = stream.num_shards
        if n < 2:
            raise DataError(f"hf:{self.name} has {n} data file(s): a run needs at least 2 (the last one is held out "
                            "for evaluation)")
        self.eval_tokens = self._eval_tokens(stream, n - 1)
        self.batches = HfBatches(self.name, self.tokenizer, self.seq_len, self.batch_size, self.peer_id, self.seed,
                                 shards=range(n - 1), stream=stream)
        if self._state is not None:
            self.batches.load_state_dict(self._state)
            self._state = None

    def _eval_tokens(self, stream, index: int) -> torch.Tensor:
        separator = torch.as_tensor(self.tokenizer.encode(DOC_SEPARATOR)).long()
        parts, have = [], 0
        for record in stream.shard(num_shards=stream.num_shards, index=index):
            text = record.get("text")
            if not isinstance(text, str):
                raise DataError(f"hf:{self.name}: a record's 'text' is {type(text).__name__}, expected a string")
            parts += [torch.as_tensor(self.tokenizer.encode(text)).long(), separator]
            have += parts[-2].numel() + separator.numel()
            if have >= self.eval_need:
                break
        if have < self.seq_len + 1:
            raise DataError(f"hf:{self.name}: the held-out last data file holds {have} tokens, fewer than one "
                            f"window of {self.seq_len + 1}")
        return torch.cat(parts)

    async def start(self) -> bool:
        await asyncio.get_running_loop().run_in_executor(None, self._open)
        return True

    async def ready(self) -> bool:
        if self._pending is None:
            state = self.batches.state_dict()
            self._pending = await asyncio.get_running_loop().run_in_executor(None, self.batches.next_batch)
            self._state = state
        return True

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pending is not None:
            batch, self._pending, self._state = self._pending, None, None
            return batch
        if self.batches is None:
            raise RuntimeError("hf: batch source not started")
        return self.batches.next_batch()

    def state_dict(self) -> dict:
        if self._state is not None:
            return dict(self._state)
        if self.batches is None:  # not started and nothing loaded: the stream's start
            return {"kind": "hf", "start": [0, 0], "documents": 0, "buffered": 0, "documents_read": 0,
                    "batches_drawn": 0, "seq_len": self.seq_len, "batch_size": self.batch_size}
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "hf":
            raise ValueError(f"sampler state of kind {state.get('kind')!r} is not that of an hf: dataset")
        for key in ("seq_len", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this stream has {getattr(self, key)}")
        self._pending = None
        if self.batches is None:
            self._state = dict(state)
        else:
            self._state = None
            self.batches.load_state_dict(state)

    async def close(self) -> None:
        self._pending = None

