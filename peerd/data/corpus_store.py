"""Local corpora of any size: read once per machine into a memory-mapped byte file, tokenized once per tokenizer.

:func:`peerd.data.corpus.load_corpus` without a cache reads every file into memory; a node's daemon passes its cache folder
(``<checkpoint_dir>/corpus-cache``), and then a local corpus is streamed in 8 MB pieces into
``text-<key>.u8`` (the same bytes, in the same order, with the same separators and the same final-5% eval cut as the
in-memory path) and memory-mapped copy-on-write, so a corpus larger than RAM trains. ``key`` names the files by path,
size and modification time (hashing terabytes on every start would cost more than it protects): a changed file gets
a new cache entry. BPE ids (:func:`encode_bytes`) are streamed the same way: documents are split at the blank-line
separator left to right across piece boundaries (so the ids equal encoding the whole text at once), encoded in
batches and appended to an int32 file.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

PIECE_BYTES = 8 << 20
"""Bytes read (or decoded) per step while streaming."""


def corpus_cache_dir(node) -> Path:
    """A node's cache of corpus bytes and token ids: ``<checkpoint_dir>/corpus-cache``."""
    return Path(node.checkpoint_path) / "corpus-cache"


def files_key(paths: Sequence[str]) -> str:
    """16 hex characters naming ``paths`` by real path, size and modification time (ns)."""
    entries = []
    for path in paths:
        st = os.stat(path)
        entries.append([os.path.realpath(path), st.st_size, st.st_mtime_ns])
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def memmap_tensor(path: str | os.PathLike, dtype: np.dtype) -> torch.Tensor:
    """The file as a copy-on-write memory-mapped 1-D tensor (writes stay private to this process)."""
    if os.path.getsize(path) == 0:
        return torch.from_numpy(np.zeros(0, dtype=dtype))
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c"))


def write_atomic_pieces(out: str | os.PathLike, pieces: Iterator[bytes]) -> int:
    """Write the byte pieces to ``out`` through a temporary file renamed at the end (a crash leaves no half file);
    returns the bytes written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    total = 0
    try:
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)
                total += len(piece)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return total


def encode_bytes(data: torch.Tensor, encode_docs: Callable[[list[str]], list[list[int]]], separator: str,
                 out: str | os.PathLike) -> torch.Tensor:
    """Token ids of ``data`` (uint8, (N,)) decoded as UTF-8 (bad bytes -> U+FFFD) and split into documents at
    ``separator``, streamed: returns an int32 memory-mapped tensor of the ids written to ``out``.

    ``encode_docs(texts) -> ids per text``. Between documents the ids of ``separator`` are inserted, computed with
    the same function, so the result equals ``encode(doc_0) + sep + encode(doc_1) + ...`` of the whole text."""
    sep_ids = np.asarray(encode_docs([separator])[0], dtype=np.int32).tobytes()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    raw = data.numpy()

    def pieces() -> Iterator[bytes]:
        carry, first = "", True
        for start in range(0, raw.size + 1, PIECE_BYTES):
            last = start + PIECE_BYTES > raw.size
            text = carry + decoder.decode(raw[start:start + PIECE_BYTES].tobytes(), final=last)
            docs = text.split(separator)
            carry = "" if last else docs.pop()  # the last piece of a chunk may continue in the next chunk
            for ids in encode_docs(docs) if docs else ():
                if not first:
                    yield sep_ids
                first = False
                yield np.asarray(ids, dtype=np.int32).tobytes()

    write_atomic_pieces(out, pieces())
    return memmap_tensor(out, np.int32)
