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

from typing import Iterator, Optional

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
    try:
        stream = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:  # the library raises many kinds (FileNotFoundError, DatasetNotFoundError, ValueError...)
        raise DataError(f"cannot open hf:{name} (split {split!r}) for streaming: {e}") from None
    if stream.column_names is not None and "text" not in stream.column_names:
        raise DataError(f"hf:{name}: no column 'text' (columns: {', '.join(stream.column_names)})")
    return stream


def peer_documents(stream, peer_id: str, seed: int) -> Iterator[str]:
    """The ``text`` of every record of ``stream`` (an ``IterableDataset``), shard by shard in this peer's order,
    then again (the next epoch, same order). Raises DataError for a record whose ``text`` is not a string or a
    stream without records."""
    n = stream.num_shards
    while True:
        read = 0
        for index in shard_order(n, peer_id, seed):
            for record in stream.shard(num_shards=n, index=index):
                text = record.get("text")
                if not isinstance(text, str):
                    raise DataError(f"a record's 'text' is {type(text).__name__}, expected a string")
                read += 1
                yield text
        if not read:
            raise DataError("the dataset holds no documents")


class HfBatches:
    """Training batches packed from a peer's stream of an ``hf:`` dataset.

    Documents are encoded one by one (``tokenizer.encode``), each followed by the separator's ids, and cut into
    consecutive windows of ``seq_len + 1`` tokens; a batch takes ``batch_size`` windows. The documents come from
    :func:`peer_documents` (this peer's shard order, epoch after epoch)."""

    def __init__(self, name: str, tokenizer, seq_len: int, batch_size: int, peer_id: str, seed: int,
                 split: str = "train"):
        """Raises ValueError (non-positive sizes), DataError (see :func:`open_stream`)."""
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
        self.name, self.tokenizer, self.seq_len, self.batch_size = name, tokenizer, seq_len, batch_size
        self._separator = torch.as_tensor(tokenizer.encode(DOC_SEPARATOR)).long()
        self._docs = peer_documents(open_stream(name, split), peer_id, seed)
        self._buffer = torch.zeros(0, dtype=torch.long)
        self.documents_read = 0
        self.batches_drawn = 0

    def _next_document(self) -> torch.Tensor:
        try:
            text = next(self._docs)
        except DataError as e:
            raise DataError(f"hf:{self.name}: {e}") from None
        self.documents_read += 1
        return torch.cat([torch.as_tensor(self.tokenizer.encode(text)).long(), self._separator])

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
        windows = tokens[:need].view(self.batch_size, self.seq_len + 1)  # (B, T+1)
        self.batches_drawn += 1
        return windows[:, :-1], windows[:, 1:]
