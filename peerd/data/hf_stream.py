"""A run's text streamed from a Hugging Face dataset (``dataset = "hf:NAME"``): no central server, no full download.

``NAME`` is what :func:`datasets.load_dataset` takes as its ``path``: a Hub dataset id (``HuggingFaceFW/fineweb``)
or a local folder of data files (``/data/corpus``: Parquet, JSON Lines, text). Every peer opens the same dataset in
streaming mode (``streaming=True``: files are read as they are consumed, nothing is downloaded ahead) and reads its
``text`` column. Each peer walks the dataset's shards (its data files, :attr:`datasets.IterableDataset.num_shards`)
one after another in its own order (:func:`peerd.data.shards.shard_order`, seeded by the run's seed and its
PeerID), so peers train on different text at the same time and a peer opens only the files it reads. Documents
are encoded with the run's tokenizer, joined by the blank-line separator and packed into contiguous windows of
``seq_len + 1`` tokens. (The library's own ``shuffle`` interleaves all shards instead, and in datasets 5.2 sleeps
5 s at the end of every pass over a Parquet stream.)

``datasets`` (``pip install 'peerd[data]'``) is imported only here, when a run names an ``hf:`` dataset. Offline use
(a local folder, or the Hub's cache) follows the library's ``HF_DATASETS_OFFLINE=1``.
"""

from __future__ import annotations

import collections
import itertools
from typing import Iterator, Optional, Sequence

import torch

from peerd.data.corpus import DOC_SEPARATOR, DataError
from peerd.data.shards import shard_order

SPEC_PREFIX = "hf:"


def parse_hf_spec(spec: str) -> Optional[str]:
    """The dataset name of a ``dataset`` value ``hf:NAME``; None for any other dataset. Raises ValueError for an
    empty name."""
    if not spec.startswith(SPEC_PREFIX):
        return None
    name = spec[len(SPEC_PREFIX):].strip()
    if not name:
        raise ValueError(f"dataset {spec!r}: expected hf:NAME (a Hugging Face dataset id or a local data folder)")
    return name


def open_stream(name: str, split: str = "train"):
    """The ``datasets.IterableDataset`` of split ``split`` of ``name``, streamed. Raises DataError (``datasets``
    missing, dataset or split not found, no column ``text``)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"dataset hf:{name} needs Hugging Face datasets (pip install 'peerd[data]')") from None
    # Where torch is installed, every IterableDataset (and every .shard() of one) puts its epoch counter in shared
    # memory for DataLoader workers; with the daemon's "file_system" sharing strategy (set by hivemind) each is a
    # file that torch_shm_manager tracks, and freeing one after the daemon stopped its helper processes aborts the
    # interpreter ("Broken pipe"). peerd reads the stream in-process only: keep the counter a plain int.
    datasets.config.TORCH_AVAILABLE = False
    try:
        stream = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:  # the library raises many kinds (FileNotFoundError, DatasetNotFoundError, ValueError...)
        raise DataError(f"cannot open hf:{name} (split {split!r}) for streaming: {e}") from None
    if stream.column_names is not None and "text" not in stream.column_names:
        raise DataError(f"hf:{name}: no column 'text' (columns: {', '.join(stream.column_names)})")
    return stream


def located_documents(stream, peer_id: str, seed: int, shards: Optional[Sequence[int]] = None,
                      start: tuple[int, int] = (0, 0)) -> Iterator[tuple[int, int, str]]:
    """``(position, record, text)`` of every record of ``stream`` (an ``IterableDataset``): the shards ``shards``
    (default: all of them) in this peer's order (``position`` = index in that order, ``record`` = index of the record
    in its shard), then again (the next epoch, same order), starting at ``start`` = ``(position, record)`` (records
    before it in that shard are read and skipped: a resume reads at most one shard again). Raises DataError for a
    record whose ``text`` is not a string or for shards without records."""
    n = stream.num_shards
    walked = list(range(n)) if shards is None else list(shards)
    if not walked:
        raise DataError("no shard of the dataset to read")
    order = [walked[i] for i in shard_order(len(walked), peer_id, seed)]
    first_pos, skip = start
    if not 0 <= first_pos < len(order) or skip < 0:
        raise DataError(f"resume position {start} is outside the {len(order)} shards")
    while True:
        read = 0
        for pos in range(first_pos, len(order)):
            records = stream.shard(num_shards=n, index=order[pos])
            for record_index, record in enumerate(itertools.islice(records, skip, None), start=skip):
                text = record.get("text")
                if not isinstance(text, str):
                    raise DataError(f"a record's 'text' is {type(text).__name__}, expected a string")
                read += 1
                yield pos, record_index, text
            skip = 0
        if not read and first_pos == 0:  # a whole epoch without a record
            raise DataError("the dataset holds no documents")
        first_pos = 0


def peer_documents(stream, peer_id: str, seed: int, shards: Optional[Sequence[int]] = None) -> Iterator[str]:
    """The ``text`` of every record of ``stream`` (an ``IterableDataset``), shard by shard in this peer's order,
    then again (the next epoch, same order); :func:`located_documents` without the locations."""
    for _, _, text in located_documents(stream, peer_id, seed, shards):
        yield text


class HfBatches:
    """Training batches packed from a peer's stream of an ``hf:`` dataset.

    Documents are encoded one by one (``tokenizer.encode``), each followed by the separator's ids, and cut into
    consecutive windows of ``seq_len + 1`` tokens; a batch takes ``batch_size`` windows. The documents come from
    :func:`located_documents` (this peer's shard order over ``shards``, epoch after epoch).

    Resume (:meth:`state_dict` / :meth:`load_state_dict`) is exact when the dataset's files and the tokenizer are
    the same: the state names the first document whose tokens are still buffered (its shard position and record
    index), how many documents the buffer spans and how many of their last tokens it holds; a resume re-reads from
    that document's shard (skipping the records before it) and re-encodes only those documents. If the dataset
    changed meanwhile (a Hub dataset updated), the stream continues from the same place in the new files."""

    def __init__(self, name: str, tokenizer, seq_len: int, batch_size: int, peer_id: str, seed: int,
                 split: str = "train", shards: Optional[Sequence[int]] = None, stream=None):
        """``shards``: indices of the data files trained on (default all); ``stream``: an already opened
        stream of ``name`` (default: :func:`open_stream`). Raises ValueError (non-positive sizes), DataError (see
        :func:`open_stream`)."""
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
        self.name, self.tokenizer, self.seq_len, self.batch_size = name, tokenizer, seq_len, batch_size
        self.peer_id, self.seed = peer_id, seed
        self.shards = None if shards is None else list(shards)
        self._stream = stream if stream is not None else open_stream(name, split)
        self._separator = torch.as_tensor(tokenizer.encode(DOC_SEPARATOR)).long()
        self._restart((0, 0))
        self.documents_read = 0
        self.batches_drawn = 0

    def _restart(self, start: tuple[int, int]) -> None:
        self._docs = located_documents(self._stream, self.peer_id, self.seed, self.shards, start)
        self._buffer = torch.zeros(0, dtype=torch.long)
        self._recent: collections.deque[tuple[int, int, int]] = collections.deque()  # (position, record, tokens)
        self._next_start = start

    def _next_document(self) -> torch.Tensor:
        try:
            pos, record, text = next(self._docs)
        except DataError as e:
            raise DataError(f"hf:{self.name}: {e}") from None
        self.documents_read += 1
        ids = torch.cat([torch.as_tensor(self.tokenizer.encode(text)).long(), self._separator])
        self._recent.append((pos, record, ids.numel()))
        self._next_start = (pos, record + 1)
        return ids

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: int64 (B, T) inputs and next-token targets, ``y[:, t] == x[:, t + 1]`` for t < T - 1.
        Raises DataError (no documents, a record without a string ``text``)."""
        need = self.batch_size * (self.seq_len + 1)
        parts = [self._buffer]
        have = self._buffer.numel()
        while have < need:
            parts.append(self._next_document())
            have += parts[-1].numel()
        tokens = torch.cat(parts)
        self._buffer = tokens[need:]
        # keep the locations of the documents the buffer still holds tokens of: the resume point
        left = self._buffer.numel()
        while self._recent and sum(n for _, _, n in list(self._recent)[1:]) >= left:
            self._recent.popleft()
        if not left:
            self._recent.clear()
        windows = tokens[:need].view(self.batch_size, self.seq_len + 1)  # (B, T+1)
        self.batches_drawn += 1
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        """Where the stream stands, in plain Python values: ``start`` (position, record) of the first document
        still buffered (or of the next one to read), ``documents`` buffered, ``buffered`` tokens, the counters and
        the sizes."""
        start = list(self._recent[0][:2]) if self._recent else list(self._next_start)
        return {"kind": "hf", "start": start, "documents": len(self._recent), "buffered": self._buffer.numel(),
                "documents_read": self.documents_read, "batches_drawn": self.batches_drawn,
                "seq_len": self.seq_len, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream of ``state`` (see the class). Raises ValueError for a state of other sizes or of
        another kind, DataError if the documents no longer hold the buffered tokens (the dataset changed)."""
        if state.get("kind") != "hf":
            raise ValueError(f"sampler state of kind {state.get('kind')!r} is not that of an hf: dataset")
        for key in ("seq_len", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this stream has {getattr(self, key)}")
        pos, record = (int(v) for v in state["start"])
        self._restart((pos, record))
        parts = [self._next_document() for _ in range(int(state["documents"]))]
        tokens = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        buffered = int(state["buffered"])
        if tokens.numel() < buffered:
            raise DataError(f"hf:{self.name}: the documents at the resume point are shorter than the checkpoint "
                            "says (the dataset changed)")
        self._buffer = tokens[tokens.numel() - buffered:]
        self.documents_read = int(state["documents_read"])
        self.batches_drawn = int(state["batches_drawn"])
