"""The run's tokenizer: UTF-8 bytes (the default) or a byte-level BPE that the run's creator trains once.

A run config names its tokenizer with ``tokenizer = "bytes"`` or ``tokenizer = "bpe:<sha256>"``, the SHA-256 of the
tokenizer file (Hugging Face ``tokenizers`` JSON, as :func:`train_bpe` writes it). The digest is part of the run's
fingerprint, so every peer tokenizes identically or is refused; the file itself is too big for a DHT record, so it
lives in each peer's tokenizer cache (``<checkpoint_dir>/tokenizers/<sha256>.json``) and a joiner without it
fetches it from a live peer of the run (:mod:`protocols.blobs`: the digest is checked before a byte is used).

Byte-level BPE (Radford et al. 2019, GPT-2 section 2.2): the base alphabet is the 256 bytes, so any text encodes
without unknown tokens; merges are learned from the corpus by frequency (``min_frequency`` 2). Training with
``tokenizers`` is deterministic for a given corpus, vocabulary size and library version: the creator trains once and
ships the file, nobody else trains.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from protocols.blobs import sha256_hex

if TYPE_CHECKING:  # torch is imported where ids are made: parsing a run config stays light
    import torch

BYTES = "bytes"
BPE_PREFIX = "bpe:"
_SPEC_RE = re.compile(r"bpe:([0-9a-f]{64})")
MAX_TOKENIZER_BYTES = 64 << 20
"""Largest tokenizer file accepted from a peer (a 256k-token BPE is ~20 MB)."""
MIN_VOCAB, MAX_VOCAB = 257, 1 << 20


class TokenizerError(RuntimeError):
    """A tokenizer spec is malformed, or its file is missing, unreadable or has another digest."""


PLACEHOLDER_DIGEST = "0" * 64
"""The digest the real-model run presets carry in place of the run's BPE (``tokenizer = "bpe:000...0"``): a daemon
refuses to start a run with it (the creator replaces it with the line ``peerd tokenizer train`` prints)."""


def parse_spec(spec: str) -> Optional[str]:
    """None for ``"bytes"``, the 64-hex digest for ``"bpe:<sha256>"``. Raises ValueError otherwise."""
    if spec == BYTES:
        return None
    match = _SPEC_RE.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"tokenizer must be 'bytes' or 'bpe:<sha256 of the tokenizer file, 64 hex>', got {spec!r}")
    return match.group(1)


class BpeTokenizer:
    """A byte-level BPE tokenizer loaded from its file's bytes; ``spec`` = ``"bpe:<sha256 of those bytes>"``."""

    def __init__(self, data: bytes):
        """Raises TokenizerError if ``data`` is not a byte-level tokenizer file of ``tokenizers``."""
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # boundary: a run's tokenizer file; `tokenizers` raises plain Exception on bad JSON
            raise TokenizerError(f"not a tokenizer file: {e}") from None
        self.data = bytes(data)
        self.digest = sha256_hex(self.data)
        self.spec = BPE_PREFIX + self.digest
        self.vocab_size = self._tok.get_vocab_size()
        if not MIN_VOCAB <= self.vocab_size <= MAX_VOCAB:
            raise TokenizerError(f"tokenizer has {self.vocab_size} tokens; expected {MIN_VOCAB}..{MAX_VOCAB}")

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike]) -> "BpeTokenizer":
        try:
            return cls(Path(path).expanduser().read_bytes())
        except OSError as e:
            raise TokenizerError(f"cannot read tokenizer file {path}: {e}") from None

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the file's exact bytes (so the digest stays the same), atomically."""
        _write_atomic(Path(path), self.data)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text``, int32 (n,)."""
        import torch

        return torch.tensor(self._tok.encode(text).ids, dtype=torch.int32)

    def encode_documents(self, docs: Sequence[str], separator: str) -> torch.Tensor:
        """Ids of ``separator.join(docs)``, int32 (n,), encoded per document in parallel (no merge crosses a
        document boundary)."""
        import numpy as np
        import torch

        sep = self._tok.encode(separator).ids
        parts: list[list[int]] = []
        for i, enc in enumerate(self._tok.encode_batch(list(docs))):
            if i:
                parts.append(sep)
            parts.append(enc.ids)
        flat = np.fromiter((t for part in parts for t in part), dtype=np.int32)
        return torch.from_numpy(flat)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text (encoded in parallel)."""
        return [enc.ids for enc in self._tok.encode_batch(texts)]

    def token_bytes(self) -> "torch.Tensor":
        """Bytes of text each token id stands for, int64 (vocab_size,): a byte-level BPE's token strings spell
        bytes in GPT-2's byte alphabet, one character per byte."""
        import torch

        lengths = torch.zeros(self.vocab_size, dtype=torch.int64)
        for token, i in self._tok.get_vocab().items():
            lengths[i] = len(token)
        return lengths

    def decode(self, tokens: Union[torch.Tensor, Sequence[int]]) -> str:
        """Text of token ids (any 1-D int tensor or sequence); ids out of range raise ValueError."""
        import torch

        ids = [int(t) for t in torch.as_tensor(tokens).reshape(-1).tolist()]
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        return self._tok.decode(ids)


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> BpeTokenizer:
    """Train a byte-level BPE on ``texts`` (documents) with ``vocab_size`` tokens (256 bytes + merges).

    Deterministic for the same texts, sizes and ``tokenizers`` version (tested: two trainings give the same file).
    Raises ValueError for a vocabulary outside 257..2**20.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be in {MIN_VOCAB}..{MAX_VOCAB}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    return BpeTokenizer(tok.to_str().encode("utf-8"))


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (Radford et al. 2019, the ``encoder.py`` of
    their release): printable Latin-1 bytes map to themselves, the others to code points from 256 up, in order.
    ``tokenizers``' ByteLevel pre-tokenizer and decoder use the same map."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def byte_level_tokenizer_json() -> str:
    """A ``tokenizers`` file whose ids are the UTF-8 bytes 0-255 of the text, as a byte-level run trains on
    (:class:`peerd.data.corpus.ByteTokenizer`): a byte-level BPE with no merges, so ``transformers`` loads a byte-level
    export like a BPE one (``AutoTokenizer.from_pretrained``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def tokenizer_dir(node) -> Path:
    """A node's tokenizer cache (and tokenized-corpus cache): ``<checkpoint_dir>/tokenizers``."""
    return Path(node.checkpoint_path) / "tokenizers"


class TokenizerCache:
    """Tokenizer files by digest in one folder (``<dir>/<sha256>.json``); what is read back is checked."""

    def __init__(self, directory: Union[str, os.PathLike]):
        self.dir = Path(directory).expanduser()

    def path(self, digest: str) -> Path:
        return self.dir / f"{digest}.json"

    def get(self, digest: str) -> Optional[BpeTokenizer]:
        """The cached tokenizer with ``digest``; None if absent. A file whose bytes have another digest (damaged)
        is removed and reported as absent."""
        path = self.path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if sha256_hex(data) != digest:
            path.unlink(missing_ok=True)
            return None
        return BpeTokenizer(data)

    def blob(self, digest: str) -> Optional[bytes]:
        """The file's bytes for serving to peers (checked like :meth:`get`), or None."""
        tok = self.get(digest)
        return tok.data if tok is not None else None

    def put(self, tokenizer: BpeTokenizer) -> Path:
        path = self.path(tokenizer.digest)
        if not path.exists():
            tokenizer.save(path)
        return path


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
